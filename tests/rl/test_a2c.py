import numpy as np
import pytest

from edurl import load_metrics
from edurl.rl import A2CConfig, train_a2c


def test_a2c_learns(tmp_path):
    result = train_a2c(A2CConfig(seed=0, total_steps=30_000, progress=False, log_dir=str(tmp_path)))
    returns = result.episodes["episode_return"].to_numpy()
    assert returns[-20:].mean() > 3 * returns[:20].mean()
    steps = result.episodes["step"].to_numpy()
    assert (np.diff(steps) >= 0).all() and steps[-1] <= 30_000 + 8 * 64  # stops at the first update past the budget
    assert {"optim/value_loss", "optim/entropy"} <= set(load_metrics(tmp_path).columns)


@pytest.mark.cuda
def test_a2c_runs_on_cuda():
    a = train_a2c(A2CConfig(seed=0, total_steps=2048, device="cuda", progress=False))
    assert next(a.value.parameters()).device.type == "cuda"


def test_a2c_with_the_learners_baseline_losses_matches_the_built_in_losses():
    import torch

    from edurl.exercises.solutions.ch03 import baseline_losses

    def wrong(logprobs, returns, values):  # the advantage's sign flipped
        return -(logprobs * (values - returns).detach()).mean(), 0.5 * ((values - returns) ** 2).mean()

    config = A2CConfig(seed=4, total_steps=2 * 8 * 64, progress=False)  # two updates
    ours, mine, bad = (train_a2c(config, losses_fn=f) for f in (None, baseline_losses, wrong))
    for a, b in zip(ours.policy.parameters(), mine.policy.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert not all(torch.allclose(a, c, atol=1e-4) for a, c in zip(ours.policy.parameters(), bad.policy.parameters()))
    for a, b in zip(ours.value.parameters(), mine.value.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
