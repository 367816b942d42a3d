import pytest
import torch

from edurl import load_metrics
from edurl.rl import ReinforceConfig, reinforce_loss, train_reinforce


def test_reinforce_loss_value_and_gradient():
    logprobs = torch.tensor([-0.5, -1.0, -2.0], requires_grad=True)
    returns = torch.tensor([1.0, 2.0, 3.0])
    loss = reinforce_loss(logprobs, returns, normalize_advantages=False)
    # -(1*-0.5 + 2*-1 + 3*-2)/3 = 8.5/3
    assert loss.item() == pytest.approx(8.5 / 3)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -returns / 3)
    logprobs.grad = None
    # normalised: returns (1, 2, 3) -> (-1, 0, 1) (mean 2, sample std 1)
    reinforce_loss(logprobs, returns, normalize_advantages=True).backward()
    torch.testing.assert_close(logprobs.grad, -torch.tensor([-1.0, 0.0, 1.0]) / 3, atol=1e-6, rtol=0)


def test_reinforce_loss_does_not_backprop_into_weights():
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    weights = torch.tensor([1.0, 3.0], requires_grad=True)
    reinforce_loss(logprobs, weights).backward()
    assert weights.grad is None
    with pytest.raises(ValueError, match="1-D of the same length"):
        reinforce_loss(logprobs, weights[:1])


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


@pytest.mark.cuda
def test_reinforce_runs_on_cuda():
    r = train_reinforce(ReinforceConfig(seed=0, max_episodes=16, device="cuda", progress=False))
    assert next(r.policy.parameters()).device.type == "cuda"
