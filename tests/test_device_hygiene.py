"""Device hygiene: edurl code never creates a tensor without saying on which device.

``torch.zeros(n)`` lands on the CPU whatever device the run uses. On a GPU run that is a crash at the
first op that mixes it with a CUDA tensor or, worse, a silent host<->device copy on every step. Such
bugs hide on the CPU-only machines where the tests usually run, so this test looks for the call, not
for its consequence: :class:`FactoryDeviceCheck`, a ``TorchFunctionMode``, sees every torch function
call and records each tensor factory (``torch.zeros``, ``torch.tensor``, ``torch.arange``, ...) that a
line in ``edurl/`` calls without ``device=``. Factories that take their device from an argument
(``*_like``, ``torch.as_tensor(tensor)``) are not factories in this sense and are left alone. A tensor
that is meant to live on the CPU (a staging buffer, a datum) says so: ``device="cpu"``.

Every trainer and sampler runs here for a few steps under the check, and the planted-bug test proves
that the check fails on one ``torch.zeros(n)`` in a trainer.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import pytest
import torch
from torch.overrides import TorchFunctionMode

import edurl
import edurl.rl.ppo
from edurl.rl import (
    A2CConfig,
    CategoricalPolicy,
    PPOConfig,
    ReinforceConfig,
    ValueNet,
    monte_carlo_value,
    policy_evaluation,
    solve_policy_values,
    train_a2c,
    train_ppo,
    train_reinforce,
    uniform_policy,
    value_iteration,
)
from edurl.rl.gae_study import gae_bias_variance, sample_trajectory
from edurl.rl.policy_gradient import bandit_gradient_samples, fit_value_baseline, gradient_variance
from edurl.rl.tabular import TabularMDP

EDURL_DIR = Path(edurl.__file__).resolve().parent
REPO_DIR = EDURL_DIR.parent

# torch functions that make a new tensor from sizes or data, with the device a keyword (default: CPU)
FACTORIES = frozenset(
    getattr(torch, name)
    for name in (
        "zeros",
        "ones",
        "full",
        "empty",
        "empty_strided",
        "arange",
        "linspace",
        "logspace",
        "eye",
        "tensor",
        "as_tensor",
        "asarray",
        "scalar_tensor",
        "rand",
        "randn",
        "randint",
        "randperm",
        "tril_indices",
        "triu_indices",
    )
)
FROM_DATA = frozenset((torch.tensor, torch.as_tensor, torch.asarray))  # a tensor argument carries its own device


class FactoryDeviceCheck(TorchFunctionMode):
    """While active, records every tensor factory called from a file under ``root`` without ``device=``.

    ``offenders`` holds one ``"edurl/path.py:LINE: torch.NAME(...) without device="`` per offending line.
    """

    def __init__(self, root: Path = EDURL_DIR):
        super().__init__()
        self.root = str(root) + "/"
        self._found: dict[str, None] = {}  # ordered, without repeats: a loop repeats its offence

    @property
    def offenders(self) -> list[str]:
        return list(self._found)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func in FACTORIES
            and kwargs.get("device") is None
            and not (func in FROM_DATA and args and isinstance(args[0], torch.Tensor))
        ):
            # factories are C functions, so the frame below this one is the line that called torch
            caller = sys._getframe(1)
            filename = caller.f_code.co_filename
            if filename.startswith(self.root):
                where = Path(filename).relative_to(REPO_DIR)
                self._found[f"{where}:{caller.f_lineno}: torch.{func.__name__}(...) without device="] = None
        return func(*args, **kwargs)


def assert_device_hygiene(run) -> None:
    """Run ``run()`` under the check; fail with the file:line of each factory call that names no device."""
    with FactoryDeviceCheck() as check:
        run()
    assert not check.offenders, (
        "edurl created tensors without an explicit device (pass device=...; "
        "device='cpu' for host-side data):\n  " + "\n  ".join(check.offenders)
    )


# ---------------------------------------------------------------------------------------------- the check itself

PLANTED = """
def planted_gae(rewards, *args):
    baseline = torch.zeros(rewards.shape[1])  # the planted bug: no device
    fine = torch.zeros(rewards.shape[1], device=rewards.device), torch.as_tensor(rewards), torch.zeros_like(rewards)
    return gae(rewards, *args)
"""


def _tiny_ppo(**kw) -> PPOConfig:
    return PPOConfig(
        **{
            **dict(
                num_envs=4,
                num_steps=8,
                num_minibatches=2,
                update_epochs=2,
                total_steps=64,
                hidden_sizes=(8,),
                device="cpu",
                progress=False,
            ),
            **kw,
        }
    )


def test_the_check_catches_a_planted_factory_call_in_a_trainer(monkeypatch):
    # code compiled with a file name inside edurl/ is, to the check, edurl code
    namespace = {"torch": torch, "gae": edurl.rl.ppo.gae}
    exec(compile(PLANTED, str(EDURL_DIR / "rl" / "_planted_bug.py"), "exec"), namespace)
    monkeypatch.setattr(edurl.rl.ppo, "gae", namespace["planted_gae"])
    with FactoryDeviceCheck() as check:
        train_ppo(_tiny_ppo())
    # line 3 only: line 4's explicit device, as_tensor of a tensor and zeros_like all name (or keep) a device
    assert check.offenders == ["edurl/rl/_planted_bug.py:3: torch.zeros(...) without device="]
    with pytest.raises(AssertionError, match=r"edurl/rl/_planted_bug.py:3: torch.zeros"):
        assert_device_hygiene(lambda: train_ppo(_tiny_ppo()))


def test_the_check_ignores_code_outside_edurl():
    with FactoryDeviceCheck() as check:
        torch.zeros(3), torch.tensor([1.0]), torch.arange(4)  # this test file is not edurl code
    assert check.offenders == []


# ---------------------------------------------------------------------------------------------- classic RL


def _tiny(**kw):
    return dict(hidden_sizes=(8,), seed=0, device="cpu", progress=True, stop_when_solved=False, **kw)


# Every trainer on both env backends (PPO's and A2C's with them both branches of collect_rollout), and the
# seed stacks of REINFORCE and A2C with two seeds.
RL_RUNS = {
    "reinforce": lambda: train_reinforce(ReinforceConfig(**_tiny(episodes_per_update=2, max_episodes=6))),
    "reinforce-value-baseline": lambda: train_reinforce(
        ReinforceConfig(**_tiny(episodes_per_update=2, max_episodes=6, baseline="value"))
    ),
    "reinforce-torch-2-seeds": lambda: train_reinforce(
        ReinforceConfig(**_tiny(episodes_per_update=2, max_episodes=6, env_backend="torch", num_seeds=2))
    ),
    "a2c": lambda: train_a2c(A2CConfig(**_tiny(num_envs=2, num_steps=8, total_steps=48))),
    "a2c-torch-2-seeds": lambda: train_a2c(
        A2CConfig(**_tiny(num_envs=2, num_steps=8, total_steps=48, env_backend="torch", num_seeds=2))
    ),
    "ppo-gymnasium": lambda: train_ppo(_tiny_ppo(env_backend="gymnasium", progress=True)),
    "ppo-torch": lambda: train_ppo(_tiny_ppo(env_backend="torch", progress=True, target_kl=0.0, clip_value=True)),
}


@pytest.mark.parametrize("name", list(RL_RUNS))
def test_rl_trainers_name_their_devices(name):
    assert_device_hygiene(RL_RUNS[name])


def _studies():
    torch.manual_seed(0)
    policy, value = CategoricalPolicy(4, 2, (8,)), ValueNet(4, (8,))
    traj = sample_trajectory(policy, value, seed=0, max_steps=20)
    gae_bias_variance(
        policy, value, traj["states"][:2], traj["actions"][:2], lams=[0.0, 1.0], num_truth=4, num_samples=4, horizon=5
    )
    fit_value_baseline(policy, "CartPole-v1", 2, 0.99, steps=2)
    gradient_variance(
        policy,
        "CartPole-v1",
        {"none": lambda obs, G: 0.0, "value": lambda obs, G: value(obs)},
        num_batches=2,
        episodes_per_batch=2,
    )
    bandit_gradient_samples(torch.zeros(3), torch.arange(3.0), torch.ones(3), 8)
    mdp = TabularMDP.from_gymnasium(gym.make("FrozenLake-v1"))
    pi = uniform_policy(mdp)
    policy_evaluation(pi, mdp, 0.9)
    solve_policy_values(pi, mdp, 0.9)
    value_iteration(mdp, 0.9)
    monte_carlo_value(gym.make("FrozenLake-v1", max_episode_steps=20), pi, 0.9, 4)


def test_chapter_studies_name_their_devices():
    assert_device_hygiene(_studies)


# ---------------------------------------------------------------------------------------------- LLM side


@pytest.fixture
def tiny_llm(tmp_path, monkeypatch):
    from edurl.llm.model import TinyLMConfig
    from edurl.llm.sft import SFTConfig

    monkeypatch.setenv("EDURL_CACHE", str(tmp_path / "cache"))  # GRPO's warm start trains here, under the check
    model = TinyLMConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    return SFTConfig(
        model=model,
        max_steps=2,
        batch_size=4,
        warmup_steps=1,
        num_threads=1,
        target_pass_at_1=0.99,
        extra_steps=0,
        check_every=1,
        num_valid=2,
    )


def test_sft_names_its_devices(tiny_llm):
    from edurl.llm.sft import train_sft

    assert_device_hygiene(lambda: train_sft(tiny_llm, progress=True, num_eval=2))


def test_grpo_and_its_baseline_name_their_devices(tiny_llm, tmp_path):
    from edurl.llm.grpo import GRPOConfig, train_grpo
    from edurl.llm.sft import continued_sft

    config = GRPOConfig(
        sft=tiny_llm,
        max_steps=2,
        batch_size=2,
        group_size=2,
        num_eval=2,
        max_tokens=6,
        eval_every=1,
        num_threads=1,
        log_kl_ref=True,
        log_dir=str(tmp_path / "grpo"),
        device="cpu",
    )
    assert_device_hygiene(lambda: train_grpo(config))  # trains the SFT warm start first, into EDURL_CACHE
    # the KL penalty in the reward (an extra reference pass) and in the loss, at a sampling temperature != 1
    for mode in ("reward", "loss"):
        assert_device_hygiene(
            lambda mode=mode: train_grpo(
                replace(config, kl_coef=0.5, kl_penalty=mode, temperature=0.7, log_dir=str(tmp_path / f"kl_{mode}"))
            )
        )
    assert_device_hygiene(lambda: continued_sft(replace(config, log_dir=str(tmp_path / "continued_sft"))))


def _sampler_runs(device: str):
    from edurl.llm import sampling
    from edurl.llm.model import TinyLMConfig, build_tiny_lm
    from edurl.llm.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    model = build_tiny_lm(tokenizer, TinyLMConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    model.to(device)
    prompts = [tokenizer.encode("12+34="), tokenizer.encode("7+8=")]
    stop = [tokenizer.eos_token_id, tokenizer.encode("\n")]

    def run():
        for params in (
            sampling.SamplingParams(max_tokens=6, stop=stop, seed=0),
            sampling.SamplingParams(max_tokens=6, temperature=0.0, stop=stop),
            sampling.SamplingParams(max_tokens=6, top_p=0.9, seed=1),
        ):
            sampling.sample(model, prompts, 3, params, pad_token_id=tokenizer.pad_token_id)
        # two turns through a prefix cache: the second runs only its new tokens against the first's keys and values
        cache, keys, params = sampling.PrefixCache(), [0, 1], sampling.SamplingParams(max_tokens=4, seed=2)
        first = sampling.sample(model, prompts, 1, params, tokenizer.pad_token_id, None, cache, keys)
        second = [p + c.tokens + tokenizer.encode("?") for p, c in zip(prompts, first)]
        sampling.sample(model, second, 1, params, tokenizer.pad_token_id, None, cache, keys)
        assert cache.hits == 2

    return run


def test_sampler_names_its_devices():
    assert_device_hygiene(_sampler_runs("cpu"))


@pytest.mark.cuda
def test_gpu_runs_name_their_devices():
    # on a GPU a missing device= is a crash or a host copy per step, not just untidy
    assert_device_hygiene(lambda: train_ppo(_tiny_ppo(env_backend="torch", device="cuda")))
    assert_device_hygiene(
        lambda: train_reinforce(
            ReinforceConfig(**{**_tiny(episodes_per_update=2, max_episodes=4, baseline="value"), "device": "cuda"})
        )
    )
    assert_device_hygiene(_sampler_runs("cuda"))


@pytest.mark.cuda
def test_sft_and_grpo_on_a_gpu_name_their_devices(tiny_llm, tmp_path):
    from edurl.llm.grpo import GRPOConfig, train_grpo

    config = GRPOConfig(
        sft=replace(tiny_llm, device="cuda"),
        max_steps=2,
        batch_size=2,
        group_size=2,
        num_eval=2,
        max_tokens=6,
        eval_every=1,
        kl_coef=0.5,
        log_dir=str(tmp_path / "grpo"),
        device="cuda",
    )
    assert_device_hygiene(lambda: train_grpo(config))
    assert next(train_grpo(replace(config, log_dir=str(tmp_path / "again"))).trainer.model.parameters()).is_cuda
