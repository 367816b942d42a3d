import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from edurl.rl import CategoricalPolicy, ValueNet
from edurl.rl.gae_study import gae_bias_variance, plot_gae, rollouts_from, sample_trajectory


def _nets():
    torch.manual_seed(0)
    return CategoricalPolicy(4, 2), ValueNet(4)


def test_sample_trajectory_shapes_and_end():
    policy, value = _nets()
    traj = sample_trajectory(policy, value, seed=0)
    T = traj["rewards"].shape[0]
    assert traj["values"].shape == (T, 1) and traj["states"].shape == (T, 4)
    assert traj["terminated"][-1, 0] and not traj["terminated"][:-1].any()


def test_plot_gae_draws_one_line_per_lambda():
    policy, value = _nets()
    ax = plot_gae(sample_trajectory(policy, value, seed=1), 0.99, (0.0, 1.0))
    assert len(ax.get_lines()) == 3  # two lambdas and the zero line
    plt.close("all")


def test_rollouts_start_from_the_given_state_and_action():
    policy, _ = _nets()
    start = torch.tensor([[0.01, 0.0, 0.02, 0.0]], dtype=torch.float64).expand(5, 4)
    ro = rollouts_from(policy, start, torch.ones(5, dtype=torch.long), 30, torch.Generator().manual_seed(0))
    assert torch.equal(ro["obs"][0], start)
    # action 1 pushes right: the cart's velocity rises by tau * xacc > 0 on the first step
    assert (ro["next_obs"][0, :, 1] > 0).all()
    assert ro["truncated"][-1].logical_or(ro["terminated"][-1]).all()


def test_gae_bias_variance_lambda_one_is_unbiased_and_most_variable():
    policy, value = _nets()  # an untrained critic: badly wrong, so small lambdas are biased
    traj = sample_trajectory(policy, value, seed=2)
    df = gae_bias_variance(
        policy,
        value,
        traj["states"][:3],
        traj["actions"][:3],
        lams=[0.0, 0.5, 1.0],
        num_truth=512,
        num_samples=256,
        horizon=200,
        progress=False,
    )
    assert list(df["lam"]) == [0.0, 0.5, 1.0]
    assert df["bias2"].iloc[0] > 10 * max(df["bias2"].iloc[-1], 0.1)  # lambda = 0 trusts the bad critic
    assert abs(df["bias2"].iloc[-1]) < 2.0  # lambda = 1 is a Monte Carlo return: unbiased up to noise
    assert df["variance"].is_monotonic_increasing
    np.testing.assert_allclose(df["mse"], df["bias2"] + df["variance"])


def test_rollouts_next_obs_is_the_final_state_at_termination():
    policy, _ = _nets()
    start = torch.tensor([[0.0, 0.0, 0.15, 1.5]], dtype=torch.float64).expand(8, 4)  # falling: ends within steps
    ro = rollouts_from(policy, start, torch.zeros(8, dtype=torch.long), 40, torch.Generator().manual_seed(1))
    assert ro["terminated"].any()
    ended = ro["next_obs"][ro["terminated"]]
    assert ((ended[:, 0].abs() > 2.4) | (ended[:, 2].abs() > 12 * 2 * 3.141592653589793 / 360)).all()
    live = ~ro["terminated"][:-1]
    assert torch.equal(ro["next_obs"][:-1][live], ro["obs"][1:][live])


def test_gae_bias_variance_uses_the_given_gae_fn():
    from edurl.rl import gae

    policy, value = _nets()
    traj = sample_trajectory(policy, value, seed=2)
    calls = []

    def spy(*args):
        calls.append(args[-1])
        return gae(*args)

    kw = dict(lams=[0.0, 1.0], num_truth=64, num_samples=32, horizon=50, progress=False, seed=1)
    mine = gae_bias_variance(policy, value, traj["states"][:2], traj["actions"][:2], gae_fn=spy, **kw)
    theirs = gae_bias_variance(policy, value, traj["states"][:2], traj["actions"][:2], **kw)
    assert calls == [0.0, 1.0, 0.0, 1.0]  # one call per lambda per state
    assert mine.equals(theirs)

    def halved(*args):
        adv, ret = gae(*args)
        return adv / 2, ret

    other = gae_bias_variance(policy, value, traj["states"][:2], traj["actions"][:2], gae_fn=halved, **kw)
    np.testing.assert_allclose(other["variance"], theirs["variance"] / 4)


def test_the_truth_is_not_cut_at_the_horizon():
    # a policy that balances for good: the Monte Carlo target once stopped at 300 steps (~5 short of Q at gamma
    # 0.99) while GAE bootstraps there, so lambda = 1 looked biased (bias^2 ~24) with an exact critic
    import torch
    from torch.distributions import Categorical

    from edurl.rl.gae_study import gae_bias_variance

    class Balancer(torch.nn.Module):
        def forward(self, obs):
            right = (obs[..., 2] + 0.5 * obs[..., 3] + 0.01 * obs[..., 0] + 0.1 * obs[..., 1]) > 0
            return Categorical(probs=torch.stack([(~right).float(), right.float()], -1) * 0.98 + 0.01)

    class Constant(torch.nn.Module):
        def forward(self, x):
            return torch.full(x.shape[:-1], (1 - 0.99**2000) / (1 - 0.99), dtype=x.dtype)

    states, actions = torch.zeros(1, 4), torch.tensor([1])
    df = gae_bias_variance(
        Balancer(), Constant(), states, actions, lams=[1.0], num_truth=128, num_samples=64, horizon=300, progress=False
    )
    assert abs(df["bias2"].iloc[0]) < 0.5


@pytest.mark.cuda
def test_the_study_runs_where_a_gpu_trained_policy_is():
    # a policy trained with the default device (CUDA on a GPU machine) used to meet a CPU env and generator here
    policy, value = (net.cuda() for net in _nets())
    traj = sample_trajectory(policy, value, seed=0, max_steps=50)
    assert traj["states"].device.type == "cuda"
    assert len(plot_gae(traj, 0.99, (0.0, 1.0)).get_lines()) == 3  # .numpy() on CUDA tensors raised
    plt.close("all")
    df = gae_bias_variance(
        policy, value, traj["states"][:2].cpu(), traj["actions"][:2].cpu(), lams=[0.0, 1.0],
        num_truth=32, num_samples=16, horizon=20, progress=False,
    )  # fmt: skip
    assert np.isfinite(df["mse"]).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_study_feeds_the_nets_their_own_dtype(dtype):
    """Nets built under a float64 default (as the seed-stack tests build them) once failed: the study cast every
    input to float32 ("mat1 and mat2 must have the same dtype")."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        policy, value = _nets()
        traj = sample_trajectory(policy, value, seed=2)
        rollouts_from(policy, torch.zeros(3, 4), torch.ones(3, dtype=torch.long), 5, torch.Generator().manual_seed(0))
        df = gae_bias_variance(
            policy, value, traj["states"][:1], traj["actions"][:1], lams=[0.0, 1.0], num_truth=16, num_samples=8,
            horizon=10, progress=False,
        )  # fmt: skip
    finally:
        torch.set_default_dtype(previous)
    assert list(df["lam"]) == [0.0, 1.0] and np.isfinite(df["mse"]).all()


def test_the_study_takes_a_critic_that_is_a_plain_function():
    """sample_trajectory takes one; the study, once it read the critic's dtype, raised AttributeError on it."""
    policy, _ = _nets()
    zero_critic = lambda obs: torch.zeros(obs.shape[:-1], dtype=obs.dtype)  # noqa: E731
    traj = sample_trajectory(policy, zero_critic, seed=2)
    df = gae_bias_variance(
        policy, zero_critic, traj["states"][:1], traj["actions"][:1], lams=[0.0, 1.0], num_truth=16, num_samples=8,
        horizon=10, progress=False,
    )  # fmt: skip
    assert list(df["lam"]) == [0.0, 1.0] and np.isfinite(df["mse"]).all()
