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
