"""Where one PPO optimizer step's time goes (issue 19): the phases of ``ppo_update``'s inner loop, timed apart.

The step is the one ``ppo_update`` takes, on one minibatch of the default ``PPOConfig`` (CartPole's shapes:
4 observations, 2 actions, 64x64 MLPs for the policy and the value, fused Adam as ``train_ppo`` makes it):
forward and loss, ``zero_grad``, ``backward``, ``clip_grad_norm_``, ``optimizer.step``. Each phase is timed
with ``perf_counter`` over ``--steps`` steps after ``--warmup`` more, on random inputs of the right shapes.

    python benchmarks/ppo_update_profile.py                  # 1 torch thread, 2000 timed steps
    python benchmarks/ppo_update_profile.py --threads 2 --steps 5000

Prints ms per step and each phase's share, from one run on one machine. Then the same step as ``train_ppo``
takes it now, on a seed stack (``edurl.rl.seed_stack``: one batched network for S seeds, its backward written
out by hand, per-seed clipping, Adam over the seeds' rows), for each S in ``--seeds``: ms per optimizer step,
and per seed. Last, one ``TorchCartPole.step`` for each size in ``--envs`` (5 x ``--steps`` steps).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from edurl.envs import TorchCartPole
from edurl.objectives import clipped_surrogate
from edurl.rl import PPOConfig
from edurl.rl.networks import CategoricalPolicy, ValueNet
from edurl.rl.ppo import PPOBatch, _stack_update, _standardised
from edurl.rl.seed_stack import ActorCriticStack, RowAdam

PHASES = ("forward + loss", "zero_grad", "backward", "clip_grad_norm_", "optimizer.step")


def profile(steps: int, warmup: int, config: PPOConfig) -> dict[str, float]:
    """Seconds per step of each phase, averaged over ``steps`` steps after ``warmup``."""
    torch.manual_seed(0)
    policy, value = CategoricalPolicy(4, 2, config.hidden_sizes), ValueNet(4, config.hidden_sizes)
    params = [*policy.parameters(), *value.parameters()]
    optimizer = torch.optim.Adam(params, lr=config.learning_rate, eps=1e-5, fused=True)
    n = config.num_envs * config.num_steps // config.num_minibatches
    obs, actions = torch.randn(n, 4), torch.randint(0, 2, (n,))
    sampling_logprobs, advantages, returns = -torch.rand(n), torch.randn(n), torch.randn(n)
    totals = dict.fromkeys(PHASES, 0.0)
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logprobs, entropy = policy.logprob_and_entropy(obs, actions)
        adv = _standardised(advantages, config)
        policy_loss = clipped_surrogate(logprobs, sampling_logprobs, adv, 0.8, 1.2).mean()
        value_loss = 0.5 * ((value(obs) - returns) ** 2).mean()
        loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy.mean()
        t1 = time.perf_counter()
        optimizer.zero_grad()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        t4 = time.perf_counter()
        optimizer.step()
        t5 = time.perf_counter()
        if i >= warmup:
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                totals[phase] += seconds
    return {phase: total / steps for phase, total in totals.items()}


def stack_step(num_seeds: int, steps: int, warmup: int, config: PPOConfig) -> float:
    """Seconds per optimizer step of ``_stack_update`` (what ``train_ppo`` runs) for ``num_seeds`` seeds, on
    random inputs of one minibatch's shape per seed."""
    stack = ActorCriticStack(range(num_seeds), 4, 2, config.hidden_sizes)
    optimizer = RowAdam(stack.rows, lr=config.learning_rate, eps=1e-5)
    n = config.num_envs * config.num_steps // config.num_minibatches
    g = torch.Generator().manual_seed(0)
    batch = PPOBatch(
        torch.randn(num_seeds, n, 4, generator=g),
        torch.randint(0, 2, (num_seeds, n), generator=g),
        -torch.rand(num_seeds, n, generator=g),
        torch.randn(num_seeds, n, generator=g),
        torch.randn(num_seeds, n, generator=g),
        torch.randn(num_seeds, n, generator=g),
    )
    _stack_update(stack, optimizer, batch, replace(config, update_epochs=warmup), 0.2)
    t0 = time.perf_counter()
    _stack_update(stack, optimizer, batch, replace(config, update_epochs=steps), 0.2)
    return (time.perf_counter() - t0) / steps


def env_step(num_envs: int, steps: int, warmup: int) -> float:
    """Seconds per ``TorchCartPole.step`` of ``num_envs`` envs on random actions (a rollout's other half)."""
    env = TorchCartPole(num_envs)
    env.reset(seed=0)
    actions = torch.randint(0, 2, (num_envs,), generator=torch.Generator().manual_seed(0))
    for _ in range(warmup):
        env.step(actions)
    t0 = time.perf_counter()
    for _ in range(steps):
        env.step(actions)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seeds", default="1,8", help="seed-stack sizes to time (comma-separated; empty: none)")
    parser.add_argument("--envs", default="8", help="TorchCartPole sizes whose step to time (comma-separated)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = PPOConfig()
    per_step = profile(args.steps, args.warmup, config)
    total = sum(per_step.values())
    n = config.num_envs * config.num_steps // config.num_minibatches
    print(
        f"PPO optimizer step: minibatch of {n}, MLPs {config.hidden_sizes}, {args.threads} torch thread(s), "
        f"torch {torch.__version__}; mean of {args.steps} steps"
    )
    print(f"{'phase':<18} {'ms':>7} {'share':>6}")
    for phase, seconds in per_step.items():
        print(f"{phase:<18} {seconds * 1e3:7.3f} {seconds / total:6.0%}")
    print(f"{'total':<18} {total * 1e3:7.3f}")
    for num_seeds in [int(x) for x in args.seeds.split(",") if x]:
        seconds = stack_step(num_seeds, args.steps, args.warmup, config)
        print(
            f"seed stack, {num_seeds} seed(s): {seconds * 1e3:.3f} ms per optimizer step, "
            f"{seconds * 1e3 / num_seeds:.3f} ms per seed"
        )
    for num_envs in [int(x) for x in args.envs.split(",") if x]:
        seconds = env_step(num_envs, 5 * args.steps, args.warmup)
        print(f"TorchCartPole.step, {num_envs} envs: {seconds * 1e6:.1f} us")


if __name__ == "__main__":
    main()
