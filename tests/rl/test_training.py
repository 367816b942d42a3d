import numpy as np
import pytest
import torch

from edurl import load_metrics
from edurl.rl import (A2CConfig, CategoricalPolicy, ReinforceConfig, ValueNet, reinforce_loss, solved_at, train_a2c,
                      train_reinforce)


def test_solved_at_hand_computed():
    assert solved_at([1, 2, 3], threshold=2, window=2) == 2  # means: 1.5, 2.5 -> episode index 2
    assert solved_at([5, 5], threshold=5, window=3) is None  # not a full window yet
    assert solved_at([0, 10, 0, 10], threshold=6, window=2) is None
    assert solved_at([475] * 100, window=100) == 99
    with pytest.raises(ValueError):
        solved_at([1], window=0)


def test_reinforce_loss_value_and_gradient():
    logprobs = torch.tensor([-0.5, -1.0, -2.0], requires_grad=True)
    returns = torch.tensor([1.0, 2.0, 3.0])
    loss = reinforce_loss(logprobs, returns, normalize=False)
    # -(1*-0.5 + 2*-1 + 3*-2)/3 = 8.5/3
    assert loss.item() == pytest.approx(8.5 / 3)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -returns / 3)
    logprobs.grad = None
    # normalised: returns (1, 2, 3) -> (-1, 0, 1) (mean 2, sample std 1)
    reinforce_loss(logprobs, returns, normalize=True).backward()
    torch.testing.assert_close(logprobs.grad, -torch.tensor([-1.0, 0.0, 1.0]) / 3, atol=1e-6, rtol=0)


def test_reinforce_loss_does_not_backprop_into_weights():
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    weights = torch.tensor([1.0, 3.0], requires_grad=True)
    reinforce_loss(logprobs, weights).backward()
    assert weights.grad is None
    with pytest.raises(ValueError, match="1-D of the same length"):
        reinforce_loss(logprobs, weights[:1])


def test_networks_shapes_and_near_uniform_start():
    torch.manual_seed(0)
    policy, value = CategoricalPolicy(4, 2), ValueNet(4)
    obs = torch.randn(5, 4)
    dist = policy(obs)
    assert dist.probs.shape == (5, 2) and value(obs).shape == (5,)
    assert (dist.probs - 0.5).abs().max() < 0.05  # small last-layer gain: close to uniform
    assert policy.act(obs).shape == (5,) and policy.act(obs, greedy=True).dtype == torch.int64


def test_reinforce_learns(tmp_path):
    result = train_reinforce(ReinforceConfig(seed=0, max_episodes=160, progress=False, log_dir=str(tmp_path)))
    returns = result.episodes["episode_return"].to_numpy()
    assert len(returns) == 160 and not result.solved
    assert returns[-40:].mean() > 3 * returns[:40].mean()  # random play lasts ~20 steps
    logged = load_metrics(tmp_path)
    assert logged["episodes"].iloc[-1] == 160 and "optim/entropy" in logged


def test_reinforce_with_value_baseline_runs():
    result = train_reinforce(ReinforceConfig(seed=1, max_episodes=24, baseline="value", progress=False))
    assert result.value is not None and len(result.episodes) == 24
    with pytest.raises(ValueError, match="baseline must be"):
        train_reinforce(ReinforceConfig(baseline="critic", progress=False))


def test_a2c_learns(tmp_path):
    result = train_a2c(A2CConfig(seed=0, total_steps=30_000, progress=False, log_dir=str(tmp_path)))
    returns = result.episodes["episode_return"].to_numpy()
    assert returns[-20:].mean() > 3 * returns[:20].mean()
    steps = result.episodes["step"].to_numpy()
    assert (np.diff(steps) >= 0).all() and steps[-1] <= 30_000 + 8 * 64  # stops at the first update past the budget
    assert {"optim/value_loss", "optim/entropy"} <= set(load_metrics(tmp_path).columns)


@pytest.mark.cuda
def test_trainers_run_on_cuda():
    r = train_reinforce(ReinforceConfig(seed=0, max_episodes=16, device="cuda", progress=False))
    assert next(r.policy.parameters()).device.type == "cuda"
    a = train_a2c(A2CConfig(seed=0, total_steps=2048, device="cuda", progress=False))
    assert next(a.value.parameters()).device.type == "cuda"


def test_episode_log_rows_and_stop_rule():
    from edurl.rl.episodes import EpisodeLog, TrainerConfig

    log = EpisodeLog(TrainerConfig(solve_threshold=10, solve_window=2))
    log.add([5.0, 20.0], [5, 20], step=25)
    assert len(log) == 2 and log.rows[1] == {"episode": 1, "step": 25, "episode_return": 20.0, "episode_length": 20,
                                             "time/total": log.rows[1]["time/total"]}
    assert log.recent_mean() == 12.5 and log.should_stop()
    result = log.result(policy=None, value=None)
    assert result.solved_episode == 2 and result.solved_step == 25
    never = EpisodeLog(TrainerConfig(solve_threshold=10, solve_window=2, stop_when_solved=False))
    never.add([50.0, 50.0], [50, 50], step=100)
    assert not never.should_stop() and never.result(None, None).solved
