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


def test_reinforce_on_gymnasium_runs_in_float64():
    # collect_episodes once made float32 observations whatever the networks' dtype: float64 runs crashed
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        result = train_reinforce(ReinforceConfig(seed=0, max_episodes=8, baseline="value", progress=False))
    finally:
        torch.set_default_dtype(old)
    assert next(result.policy.parameters()).dtype == torch.float64 and len(result.episodes) == 8


@pytest.mark.cuda
def test_reinforce_runs_on_cuda():
    r = train_reinforce(ReinforceConfig(seed=0, max_episodes=16, device="cuda", progress=False))
    assert next(r.policy.parameters()).device.type == "cuda"


def _flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.mark.parametrize("baseline", ["none", "value"])
def test_seed_i_of_a_reinforce_stack_is_the_run_of_seed_i_alone(baseline):
    """Issue 19: ReinforceConfig(num_seeds=3, env_backend="torch") trains seeds 5, 6, 7 in one TorchCartPole.
    Their episodes differ in length, so the stack's loop runs until the longest ends; each seed must still equal
    its lone run bit for bit in float64 (weights and episodes after 4 updates)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        kw = dict(env_backend="torch", device="cpu", progress=False, max_episodes=32, baseline=baseline)
        stacked = train_reinforce(ReinforceConfig(seed=5, num_seeds=3, **kw))
        assert isinstance(stacked, list) and len(stacked) == 3
        for i, result in enumerate(stacked):
            alone = train_reinforce(ReinforceConfig(seed=5 + i, **kw))
            assert result.config == alone.config
            assert torch.equal(_flat(result.policy), _flat(alone.policy))
            if baseline == "value":
                assert torch.equal(_flat(result.value), _flat(alone.value))
            else:
                assert result.value is None
            cols = ["episode", "step", "episode_return", "episode_length"]
            assert result.episodes[cols].equals(alone.episodes[cols])
        lengths = [r.episodes["episode_length"].to_numpy() for r in stacked]
        assert len(lengths[0]) == 32 and not all((lengths[0] == x).all() for x in lengths[1:])
    finally:
        torch.set_default_dtype(old)


def test_a_reinforce_stack_learns_and_its_seeds_leave_when_they_solve(tmp_path):
    kw = dict(env_backend="torch", device="cpu", progress=False, solve_threshold=60.0, solve_window=16)
    stacked = train_reinforce(ReinforceConfig(seed=0, num_seeds=3, max_episodes=400, log_dir=str(tmp_path), **kw))
    assert all(r.solved for r in stacked)
    for i, result in enumerate(stacked):
        alone = train_reinforce(ReinforceConfig(seed=i, max_episodes=400, **kw))
        assert result.solved_episode == alone.solved_episode and torch.equal(_flat(result.policy), _flat(alone.policy))
        logged = load_metrics(tmp_path / f"seed{i}")
        assert {"optim/policy_loss", "optim/entropy", "env/episode_return_mean"} <= set(logged.columns)
        assert len(logged) == len(result.episodes) // 8  # one row per update, until the seed left
    assert len({r.solved_episode for r in stacked}) > 1


def test_the_torch_backend_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="env_backend='torch'"):
        ReinforceConfig(num_seeds=2)
    with pytest.raises(ValueError, match="value_learning_rate == learning_rate"):
        ReinforceConfig(env_backend="torch", baseline="value", value_learning_rate=0.001)
    with pytest.raises(ValueError, match="update_fn"):
        train_reinforce(ReinforceConfig(env_backend="torch", progress=False), update_fn=lambda *a: None)


@pytest.mark.cuda
def test_a_reinforce_stack_runs_on_cuda():
    results = train_reinforce(
        ReinforceConfig(env_backend="torch", num_seeds=2, max_episodes=16, device="cuda", progress=False)
    )
    assert [next(r.policy.parameters()).device.type for r in results] == ["cuda", "cuda"]


def test_an_update_fn_that_returns_the_loss_as_a_float_still_logs(tmp_path):
    """Exercise 2.2's text says reinforce_update returns (batch, loss), and its checker accepts loss.item(); the
    trainer's logging then failed on float.detach()."""
    from edurl.exercises.solutions.ch02 import reinforce_update

    def update_with_a_float_loss(*args):
        batch, loss = reinforce_update(*args)
        return batch, loss.item()

    config = ReinforceConfig(max_episodes=16, log_dir=str(tmp_path / "run"), progress=False)
    result = train_reinforce(config, update_fn=update_with_a_float_loss)
    assert len(result.episodes) >= 16
    assert load_metrics(tmp_path / "run")["optim/policy_loss"].notna().all()


@pytest.mark.parametrize("backend, num_seeds", [("gymnasium", 1), ("torch", 1), ("torch", 2)])
def test_a_loss_fn_that_forgets_the_mean_is_named(backend, num_seeds):
    """Per-step losses once reached backward() and failed there ("grad can be implicitly created only for scalar
    outputs"), or, in the seed stack, summed with the value loss into a shape error."""
    per_step = lambda lp, w: -(lp * w)  # noqa: E731
    config = ReinforceConfig(max_episodes=8, progress=False, env_backend=backend, num_seeds=num_seeds)
    with pytest.raises(ValueError, match=r"loss_fn returned a loss of shape \(\d+,\); .*\.mean\(\)"):
        train_reinforce(config, loss_fn=per_step)
    # a one-element loss that kept its dimension is a loss, as check_reinforce_loss accepts it
    train_reinforce(config, loss_fn=lambda lp, w: -(lp * w).mean(0, keepdim=True))


@pytest.mark.parametrize("given", ["value", "value_optimizer"])
def test_reinforce_update_wants_a_baseline_and_its_optimizer_together(given):
    import gymnasium as gym

    from edurl.rl import CategoricalPolicy, ValueNet, reinforce_update

    policy = CategoricalPolicy(4, 2)
    value = ValueNet(4)
    kwargs = {"value": value} if given == "value" else {"value_optimizer": torch.optim.Adam(value.parameters())}
    envs = [gym.make("CartPole-v1")]
    played = []
    policy.act = lambda *a, **k: played.append(1) or CategoricalPolicy.act(policy, *a, **k)
    with pytest.raises(ValueError, match=f"got {given} without .*a learned baseline needs both"):
        reinforce_update(policy, torch.optim.Adam(policy.parameters()), envs, [0], 0.99, torch.device("cpu"), **kwargs)
    assert not played  # refused before any episode was played
