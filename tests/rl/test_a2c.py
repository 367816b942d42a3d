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


def test_a2c_takes_one_element_losses_as_the_checker_does():
    """check_baseline_losses accepts any one-element loss, e.g. mean(0, keepdim=True), shape (1,); train_a2c must
    too (it stacked the seeds' losses and failed on shape (1,))."""
    import torch

    from edurl.exercises.solutions.ch03 import baseline_losses

    def keepdim(logprobs, returns, values):
        return tuple(x.reshape(1) for x in baseline_losses(logprobs, returns, values))

    config = A2CConfig(seed=4, num_seeds=2, env_backend="torch", device="cpu", total_steps=2 * 8 * 64, progress=False)
    for ours, mine in zip(train_a2c(config, losses_fn=baseline_losses), train_a2c(config, losses_fn=keepdim)):
        assert torch.equal(_flat(ours.policy), _flat(mine.policy))


def _flat(module):
    import torch

    return torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.mark.parametrize(
    "backend, learners, num_envs",
    [("torch", False, 8), ("gymnasium", False, 8), ("torch", True, 8), ("torch", False, 1)],
)
def test_seed_i_of_an_a2c_stack_is_the_run_of_seed_i_alone(backend, learners, num_envs):
    """Issue 19: A2CConfig(num_seeds=3) trains seeds 5, 6, 7 in one process; each equals its lone run bit for bit
    in float64 (weights and episodes after 4 updates), with the library's losses and with the learner's
    exercise 3.1 called seed by seed."""
    import torch

    from edurl.exercises.solutions.ch03 import baseline_losses

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        kw = dict(env_backend=backend, device="cpu", progress=False, stop_when_solved=False, num_envs=num_envs)
        # 4 updates; 8 with one env, where the seed-major batch was once a strided view that summed in another order
        kw["total_steps"] = 4 * 8 * 64 if num_envs == 8 else 8 * 64
        losses = baseline_losses if learners else None
        stacked = train_a2c(A2CConfig(seed=5, num_seeds=3, **kw), losses_fn=losses)
        assert isinstance(stacked, list) and len(stacked) == 3
        for i, result in enumerate(stacked):
            alone = train_a2c(A2CConfig(seed=5 + i, **kw), losses_fn=losses)
            assert result.config == alone.config
            assert torch.equal(_flat(result.policy), _flat(alone.policy))
            assert torch.equal(_flat(result.value), _flat(alone.value))
            cols = ["episode", "step", "episode_return", "episode_length"]
            assert result.episodes[cols].equals(alone.episodes[cols])
        assert not torch.equal(_flat(stacked[0].policy), _flat(stacked[1].policy))
    finally:
        torch.set_default_dtype(old)


def test_a2c_seeds_leave_the_stack_when_they_solve(tmp_path):
    import torch

    kw = dict(env_backend="torch", device="cpu", progress=False, solve_threshold=30.0, solve_window=10)
    stacked = train_a2c(A2CConfig(seed=0, num_seeds=3, total_steps=512 * 30, log_dir=str(tmp_path), **kw))
    for i, result in enumerate(stacked):
        alone = train_a2c(A2CConfig(seed=i, total_steps=512 * 30, **kw))
        assert result.solved and result.solved_step == alone.solved_step
        assert torch.equal(_flat(result.policy), _flat(alone.policy))
        assert len(load_metrics(tmp_path / f"seed{i}")) == result.solved_step // 512  # one row per update
    assert len({r.solved_step for r in stacked}) > 1  # they stopped at different updates


@pytest.mark.cuda
def test_an_a2c_stack_runs_on_cuda():
    results = train_a2c(A2CConfig(env_backend="torch", num_seeds=2, total_steps=2048, device="cuda", progress=False))
    assert [next(r.value.parameters()).device.type for r in results] == ["cuda", "cuda"]
