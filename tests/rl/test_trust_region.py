import math

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from edurl.rl.networks import CategoricalPolicy, ValueNet
from edurl.rl.ppo import PPOConfig, collect_batch, make_env
from edurl.rl.trust_region import clip_vs_no_clip, exact_is_variance, importance_sampling_study, plot_trust_region


def test_exact_is_variance_hand_values_and_a_slow_reference():
    assert exact_is_variance(0.0) == 1.0  # no shift: the weights are 1 and Var[x] = 1
    assert exact_is_variance(1.0) == pytest.approx(5 * math.e - 1)
    # an independent check: numerical integration of (pi^2 / q) x^2 over a fine grid, minus mu^2
    x = torch.linspace(-12, 14, 200_001, dtype=torch.float64)
    for mu in (0.5, 1.2):
        pi = torch.exp(-((x - mu) ** 2) / 2) / math.sqrt(2 * math.pi)
        q = torch.exp(-(x**2) / 2) / math.sqrt(2 * math.pi)
        second = torch.trapezoid(pi**2 / q * x**2, x).item()
        assert exact_is_variance(mu) == pytest.approx(second - mu**2, rel=1e-6)


def test_importance_sampling_is_unbiased_and_its_spread_grows():
    df = importance_sampling_study(shifts=(0.0, 0.5, 1.0), batch_size=64, num_batches=4000, seed=1)
    assert (df["mean_estimate"] - df["shift"]).abs().max() < 0.05
    assert df["batch_std"].is_monotonic_increasing and df["ess_fraction"].is_monotonic_decreasing
    assert ((df["batch_std"] / df["exact_batch_std"]) - 1).abs().max() < 0.1
    assert df["kl"].tolist() == [0.0, 0.125, 0.5]


def test_clip_vs_no_clip_on_one_batch():
    config = PPOConfig(env_backend="torch", num_envs=8, num_steps=32, learning_rate=3e-3)
    torch.manual_seed(0)
    env, obs, obs_dim, num_actions = make_env(config, torch.device("cpu"))
    policy, value = CategoricalPolicy(obs_dim, num_actions), ValueNet(obs_dim)
    batch, *_ = collect_batch(env, policy, value, obs, config, torch.device("cpu"))
    before = [p.detach().clone() for p in policy.parameters()]
    df = clip_vs_no_clip(policy, value, batch, config, epochs=10)
    assert len(df) == 2 * 11 and (df[df["epoch"] == 0]["approx_kl_k3"] == 0).all()
    last = df[df["epoch"] == 10].set_index("run")
    assert last.loc["no clip", "approx_kl_k3"] > last.loc["clipped", "approx_kl_k3"]
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))  # the caller's nets are untouched
    axes = plot_trust_region(importance_sampling_study(shifts=(0.0, 0.5), num_batches=50), df)
    assert len(axes[1].lines) == 2


def test_both_runs_shuffle_alike_so_they_differ_only_by_the_clip():
    """Each run drew its minibatch orders from the global generator in turn, so with num_minibatches > 1 the two
    runs differed where the clip never binds; and the global stream moved on."""
    config = PPOConfig(env_backend="torch", num_envs=8, num_steps=32, num_minibatches=4)
    torch.manual_seed(0)
    env, obs, obs_dim, num_actions = make_env(config, torch.device("cpu"))
    policy, value = CategoricalPolicy(obs_dim, num_actions), ValueNet(obs_dim)
    batch, *_ = collect_batch(env, policy, value, obs, config, torch.device("cpu"))
    state = torch.get_rng_state()
    df = clip_vs_no_clip(policy, value, batch, config, epochs=2, clip_eps=1e6)  # a clip that never binds
    runs = [d.drop(columns="run").reset_index(drop=True) for _, d in df.groupby("run", sort=False)]
    assert runs[0].equals(runs[1]) and runs[0]["approx_kl_k3"].iloc[-1] > 0
    assert torch.equal(torch.get_rng_state(), state)
