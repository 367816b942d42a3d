import pytest
import torch

from edurl._checks import check_gamma, check_same_shape, check_tensor


def test_check_gamma():
    assert check_gamma(torch.tensor(0.5)) == 0.5 and check_gamma(1) == 1.0
    with pytest.raises(ValueError, match=r"must be in \[0, 1\], got 1.5"):
        check_gamma(1.5)
    with pytest.raises(TypeError, match="got bool"):
        check_gamma(True)
    with pytest.raises(TypeError, match="got str"):
        check_gamma("0.9")


def test_check_tensor():
    x = torch.zeros(2, 3)
    assert check_tensor(x, "x", ndim=(2,), floating=True) is x
    with pytest.raises(TypeError, match=r"Wrap it with torch.as_tensor"):
        check_tensor([1.0, 2.0], "x")
    with pytest.raises(ValueError, match=r"got shape \(2, 3\)"):
        check_tensor(x, "x", ndim=(1,))
    with pytest.raises(TypeError, match=r"Use x.float\(\)"):
        check_tensor(torch.zeros(2, dtype=torch.long), "x", floating=True)


def test_check_same_shape():
    check_same_shape(torch.zeros(2), torch.ones(2), "a", "b")
    with pytest.raises(ValueError, match=r"a and b must have the same shape, got \(2,\) and \(3,\)"):
        check_same_shape(torch.zeros(2), torch.zeros(3), "a", "b")


def test_check_fields_names_the_config_the_field_and_the_rule():
    from dataclasses import dataclass

    from edurl._checks import check_fields

    @dataclass
    class Cfg:
        n: int = 1
        lr: float = 0.1
        kl: float | None = None
        mode: str = "a"

    check_fields(
        Cfg(), positive_int=("n",), nonneg=("lr",), positive=("kl",), optional=("kl",), choices={"mode": ("a", "b")}
    )
    cases = [
        ({"n": 0}, r"Cfg.n must be a positive int, got 0"),
        ({"n": True}, r"Cfg.n must be a positive int"),
        ({"n": 2.0}, r"Cfg.n must be a positive int, got 2.0"),
        ({"lr": -1e-3}, r"Cfg.lr must be a finite"),
        ({"lr": float("nan")}, r"Cfg.lr must be a finite number >= 0, got nan"),
        ({"kl": 0.0}, r"Cfg.kl must be a finite number > 0 or None, got 0.0"),
        ({"mode": "c"}, r"Cfg.mode must be one of 'a', 'b'; got 'c'"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            check_fields(
                Cfg(**fields),
                positive_int=("n",),
                nonneg=("lr",),
                positive=("kl",),
                optional=("kl",),
                choices={"mode": ("a", "b")},
            )


def _configs():
    from edurl.llm.grpo import GRPOConfig
    from edurl.llm.model import TinyLMConfig
    from edurl.llm.sft import SFTConfig
    from edurl.llm.tasks import TaskConfig
    from edurl.recipes.gae_visualizer import GAEVisualizerConfig
    from edurl.rl.a2c import A2CConfig
    from edurl.rl.ppo import PPOConfig
    from edurl.rl.reinforce import ReinforceConfig

    return [
        (ReinforceConfig, {"episodes_per_update": 0}, "ReinforceConfig.episodes_per_update must be a positive int"),
        (ReinforceConfig, {"gamma": 1.5}, "ReinforceConfig.gamma must be a number in"),
        (ReinforceConfig, {"baseline": "critic"}, "ReinforceConfig.baseline must be one of 'none', 'value'"),
        (ReinforceConfig, {"hidden_sizes": ()}, "ReinforceConfig.hidden_sizes must be a non-empty tuple"),
        (ReinforceConfig, {"solve_window": 0}, "ReinforceConfig.solve_window must be a positive int"),
        (ReinforceConfig, {"num_threads": 0}, "ReinforceConfig.num_threads must be a positive int or None"),
        (A2CConfig, {"lam": -0.1}, "A2CConfig.lam must be a number in"),
        (A2CConfig, {"learning_rate": -1.0}, "A2CConfig.learning_rate must be a finite number >= 0"),
        (PPOConfig, {"num_minibatches": 3}, r"num_minibatches \(3\) must divide num_envs \* num_steps \(256\)"),
        (PPOConfig, {"clip_eps": 0.0}, "PPOConfig.clip_eps must be a finite number > 0"),
        (PPOConfig, {"target_kl": -0.01}, "PPOConfig.target_kl must be a finite number >= 0 or None"),
        (PPOConfig, {"env_backend": "jax"}, "PPOConfig.env_backend must be one of 'gymnasium', 'torch'"),
        (TaskConfig, {"num_digits": 0}, r"num_digits must be an int in \[1, 9\]"),
        (SFTConfig, {"ops": ("*",)}, "ops must be a non-empty tuple of"),
        (SFTConfig, {"batch_size": 0}, "SFTConfig.batch_size must be a positive int"),
        (SFTConfig, {"target_pass_at_1": 1.5}, r"SFTConfig.target_pass_at_1 must be a number in \[0, 1\] or None"),
        (TinyLMConfig, {"num_heads": 3}, r"hidden_size \(128\) must be divisible by num_heads \(3\)"),
        (TinyLMConfig, {"arch": "gpt2"}, "TinyLMConfig.arch must be one of"),
        (GAEVisualizerConfig, {"lams": (0.5, 1.2)}, r"lams must be one or more numbers in \[0, 1\]"),
        # a bool field takes only a bool: the string "False" is truthy, and was taken as True
        (PPOConfig, {"anneal_lr": "False"}, "PPOConfig.anneal_lr must be True or False, got 'False'"),
        (GRPOConfig, {"center_advantages": "False"}, "GRPOConfig.center_advantages must be True or False"),
        (GRPOConfig, {"progress": 0}, "GRPOConfig.progress must be True or False, got 0"),
        (GRPOConfig, {"seed": -1}, "GRPOConfig.seed must be an int >= 0"),
        (GRPOConfig, {"log_dir": 3}, "GRPOConfig.log_dir must be a folder path, got 3"),
    ]


@pytest.mark.parametrize("cls, fields, message", _configs(), ids=lambda x: getattr(x, "__name__", None))
def test_every_config_refuses_a_bad_field_when_it_is_made(cls, fields, message):
    cls()  # the defaults are valid
    with pytest.raises(ValueError, match=message):
        cls(**fields)


def test_numpy_ints_are_counts_and_seeds_and_are_stored_as_python_ints():
    """``for seed in np.arange(10): PPOConfig(seed=seed)`` was refused ("must be an int >= 0, got np.int64(0)")."""
    import json
    from dataclasses import asdict

    import numpy as np

    from edurl.llm.sft import SFTConfig
    from edurl.rl import PPOConfig

    for seed in np.arange(2):
        config = PPOConfig(seed=seed, num_envs=np.int32(4), hidden_sizes=tuple(np.array([32, 32])))
        assert config.seed == seed and type(config.seed) is int and type(config.num_envs) is int
        assert config.hidden_sizes == (32, 32) and all(type(s) is int for s in config.hidden_sizes)
        json.dumps(asdict(SFTConfig(seed=seed)))  # config.json takes it: np.int64 is not JSON
    for bad in (np.int64(-1), True, 2.0):
        with pytest.raises(ValueError, match="PPOConfig.seed must be an int >= 0"):
            PPOConfig(seed=bad)


def test_the_hand_written_count_checks_take_numpy_ints_too():
    """SamplingParams(max_tokens=np.int64(8)), Dr. GRPO's max_tokens, LengthBiasConfig and staleness_schedule
    each had their own isinstance(int) test, which refused NumPy ints that the configs take."""
    import json
    from dataclasses import asdict

    import numpy as np

    from edurl.llm.length_bias import LengthBiasConfig
    from edurl.llm.losses import check_aggregation
    from edurl.llm.sampling import SamplingParams
    from edurl.plotting import staleness_schedule

    params = SamplingParams(max_tokens=np.int64(8), stop=[np.int64(3)])
    assert params.max_tokens == 8 and type(params.max_tokens) is int and params.stop_sequences() == [[3]]
    check_aggregation("seq_mean_token_sum_norm", np.int64(16))
    config = LengthBiasConfig(steps=np.int64(2), max_tokens=np.int32(8))
    assert type(config.steps) is int and type(config.max_tokens) is int
    json.dumps(asdict(config))
    assert staleness_schedule(np.int64(1), np.int64(3)).equals(staleness_schedule(1, 3))
    for bad in (True, 2.0, np.int64(0)):
        with pytest.raises(ValueError, match="max_tokens must be a positive int"):
            SamplingParams(max_tokens=bad)
        with pytest.raises(ValueError, match="needs max_tokens, a positive int"):
            check_aggregation("seq_mean_token_sum_norm", bad)
        with pytest.raises(ValueError, match="steps must be a positive int"):
            LengthBiasConfig(steps=bad)
        with pytest.raises(ValueError, match="steps must be an int >= 1"):
            staleness_schedule(1, bad)
