"""Seeds as a batch dimension (PPOConfig.num_seeds): seed i of a stack is the run of seed i alone, and no
gradient crosses from one seed to another."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from edurl.envs import TorchCartPole
from edurl.objectives import clipped_surrogate, entropy
from edurl.rl.networks import CategoricalPolicy, ValueNet
from edurl.rl.ppo import PPOBatch, PPOConfig, _loss_grads, _stack_update, ppo_update, train_ppo
from edurl.rl.seed_stack import ActorCriticStack, RowAdam, clip_grad_norm_per_seed_, keep_seeds


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.mark.parametrize(
    "backend, extra",
    [
        ("torch", {}),
        ("gymnasium", {}),
        # minibatches draw a permutation per seed; target_kl stops seeds' epochs at different times
        ("torch", {"num_minibatches": 4, "target_kl": 0.003, "clip_value": True, "ent_coef": 0.01}),
        # one env per seed: the seed-major batch was once a strided view there, and summed in another order
        ("gymnasium", {"num_envs": 1}),
    ],
)
def test_seed_i_of_a_stack_is_the_run_of_seed_i_alone(float64, backend, extra):
    kw = dict(env_backend=backend, device="cpu", progress=False, total_steps=256 * 4, stop_when_solved=False, **extra)
    stacked = train_ppo(PPOConfig(seed=5, num_seeds=3, **kw))
    assert isinstance(stacked, list) and len(stacked) == 3
    for i, result in enumerate(stacked):
        alone = train_ppo(PPOConfig(seed=5 + i, **kw))
        assert result.config == alone.config  # each seed's result carries its own run's config
        assert torch.equal(_flat(result.policy), _flat(alone.policy))  # bit for bit, after 4 updates
        assert torch.equal(_flat(result.value), _flat(alone.value))
        cols = ["episode", "step", "episode_return", "episode_length"]
        assert result.episodes[cols].equals(alone.episodes[cols])
        assert result.updates.equals(alone.updates)
    if "target_kl" in extra:
        epochs = np.stack([r.updates["epochs"].to_numpy() for r in stacked])
        assert (epochs < 20).any() and len(np.unique(epochs)) > 1  # the early stops were per seed and differed
    first = [_flat(r.policy) for r in stacked]
    assert not torch.equal(first[0], first[1])  # the seeds are different runs


@pytest.mark.parametrize("backend", ["torch", "gymnasium"])
def test_a_solved_seed_leaves_while_the_others_go_on(backend):
    """Seed-by-seed stopping: with stop_when_solved a seed leaves the stack (its envs, rows and optimiser state
    are dropped), and each seed's result, including the ones that trained on after, is its own run's."""
    kw = dict(env_backend=backend, device="cpu", progress=False, solve_threshold=30.0, solve_window=10)
    stacked = train_ppo(PPOConfig(seed=0, num_seeds=3, total_steps=256 * 30, **kw))
    for i, result in enumerate(stacked):
        alone = train_ppo(PPOConfig(seed=i, total_steps=256 * 30, **kw))
        assert result.solved and result.solved_step == alone.solved_step
        assert len(result.episodes) == len(alone.episodes) and len(result.updates) == len(alone.updates)
        assert torch.equal(_flat(result.policy), _flat(alone.policy))
    assert len({len(r.updates) for r in stacked}) > 1  # they stopped at different updates


def _adam(stack: ActorCriticStack) -> RowAdam:
    return RowAdam(stack.rows, lr=1e-3, eps=1e-5)


def test_no_gradient_leaks_between_seeds():
    stack = ActorCriticStack([0, 1, 2], obs_dim=4, num_actions=2)
    obs, actions = torch.randn(3, 32, 4), torch.randint(0, 2, (3, 32))

    def grads(scale_seed_1: float) -> list[torch.Tensor]:
        for row in stack.rows:
            row.grad = None
        lp, ent, values = stack.evaluate(obs, actions)
        loss = (lp.mean(-1) + values.pow(2).mean(-1) - 0.1 * ent.mean(-1)) * torch.tensor([1.0, scale_seed_1, 1.0])
        loss.sum().backward()
        return [row.grad.clone() for row in stack.rows]

    base, perturbed = grads(1.0), grads(-7.0)
    assert torch.equal(base[0], perturbed[0]) and torch.equal(base[2], perturbed[2])
    assert not torch.allclose(base[1], perturbed[1])
    # and through a whole update: a seed whose advantages are flipped changes no other seed's parameters
    batch = PPOBatch(obs, actions, -torch.rand(3, 32), torch.randn(3, 32), torch.randn(3, 32), torch.randn(3, 32))
    config = PPOConfig(update_epochs=3, num_envs=4, num_steps=8, num_minibatches=2)
    after = []
    for flip in (1.0, -1.0):
        s = ActorCriticStack([0, 1, 2], 4, 2)
        b = PPOBatch(**{**batch.__dict__, "advantages": batch.advantages * torch.tensor([[1.0], [flip], [1.0]])})
        _stack_update(s, _adam(s), b, config, 0.2)
        after.append([row.detach().clone() for row in s.rows])
    assert torch.equal(after[0][0], after[1][0]) and torch.equal(after[0][2], after[1][2])
    assert not torch.equal(after[0][1], after[1][1])


@pytest.mark.parametrize("hidden_sizes, num_actions", [((64, 64), 2), ((16,), 3), ((8, 6, 5), 2)])
@pytest.mark.parametrize("num_seeds", [1, 3])
def test_backward_rows_is_autograds_gradient(float64, hidden_sizes, num_actions, num_seeds):
    """The stack's hand-written backward gives each row the gradient autograd gives through evaluate's graph."""
    stack = ActorCriticStack(range(num_seeds), 4, num_actions, hidden_sizes)
    g = torch.Generator().manual_seed(2)
    obs = torch.randn(num_seeds, 40, 4, generator=g)
    grad_logits = torch.randn(num_seeds, 40, num_actions, generator=g)
    grad_values = torch.randn(num_seeds, 40, generator=g)
    layers = stack._layers()
    logits, values = stack._mlp("policy", obs, layers), stack._mlp("value", obs, layers).squeeze(-1)
    ((logits * grad_logits).sum() + (values * grad_values).sum()).backward()
    by_autograd = [row.grad.clone() for row in stack.rows]
    saved_logits, saved_values, saved = stack.forward_saved(obs)
    assert torch.equal(saved_logits, logits.detach()) and torch.equal(saved_values, values.detach())
    stack.backward_rows(saved, grad_logits, grad_values)
    for row, expected in zip(stack.rows, by_autograd):
        torch.testing.assert_close(row.grad, expected, rtol=1e-12, atol=1e-14)


def _loss_by_autograd(logits, values, mb, adv, config, clip_eps):
    """The loss of ppo_update, per seed and summed over seeds, through autograd: the reference for _loss_grads."""
    logits, values = logits.clone().requires_grad_(), values.clone().requires_grad_()
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, mb.actions.unsqueeze(-1)).squeeze(-1)
    policy_loss = clipped_surrogate(lp, mb.sampling_logprobs, adv, 1 - clip_eps, 1 + clip_eps).mean(-1)
    if config.clip_value:
        clipped = mb.values + (values - mb.values).clamp(-clip_eps, clip_eps)
        value_loss = 0.5 * torch.max((values - mb.returns) ** 2, (clipped - mb.returns) ** 2).mean(-1)
    else:
        value_loss = 0.5 * ((values - mb.returns) ** 2).mean(-1)
    loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy(logp).mean(-1)
    loss.sum().backward()
    return lp.detach(), logits.grad, values.grad


@pytest.mark.parametrize(
    "extra, clip_eps, num_actions",
    [
        ({}, 0.2, 2),
        ({"ent_coef": 0.01, "clip_value": True, "vf_coef": 0.7}, 0.25, 2),
        ({"clip_value": True}, 0.0, 2),
        ({"ent_coef": 0.05}, 0.2, 5),  # the entropy's gradient where it has more than one free direction
    ],
)
def test_ppo_loss_gradients_in_closed_form_are_autograds(float64, extra, clip_eps, num_actions):
    """_loss_grads, which the stack's update backpropagates by hand, against autograd through ppo_update's loss,
    on outputs that hit the edge cases: ratios above and below the clip range, a value moved exactly clip_eps
    from its old prediction (the clamp still passes it), clipped and unclipped squares that tie (torch.max
    splits the gradient), and with clip_eps 0 every ratio exactly on the (zero-width) range."""
    config = PPOConfig(**extra)
    g = torch.Generator().manual_seed(3)
    S, M = 2, 48
    logits = torch.randn(S, M, num_actions, generator=g)
    actions = torch.randint(0, num_actions, (S, M), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    sampling_logprobs = lp + (0.0 if clip_eps == 0 else 0.4 * torch.randn(S, M, generator=g))
    values, returns = torch.randn(S, M, generator=g), torch.randn(S, M, generator=g)
    old_values = values - clip_eps * torch.randn(S, M, generator=g).sign() * 2 * torch.rand(S, M, generator=g)
    # exact edge cases in the first columns: moved by exactly +-clip_eps (0.25 and 0 are exact), and a tie
    values[:, :3], old_values[:, :3], returns[:, :3] = 0.5, torch.tensor([0.25, 0.75, 0.5]), 0.0
    values[:, 3], returns[:, 3], old_values[:, 3] = 1.0, 0.0, -1.25  # clipped c = -1: (1 - 0)^2 == (-1 - 0)^2
    mb = PPOBatch(torch.zeros(S, M, 4), actions, sampling_logprobs, torch.randn(S, M, generator=g), returns, old_values)
    adv = torch.randn(S, M, generator=g)
    expected = _loss_by_autograd(logits, values, mb, adv, config, clip_eps)
    got = _loss_grads(logits, values, mb, adv, config, clip_eps)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    ratio = (lp - sampling_logprobs).exp()
    if clip_eps > 0:  # the inputs did cover both sides of the clip range
        assert (ratio > 1 + clip_eps).any() and (ratio < 1 - clip_eps).any()


def test_a_seed_whose_target_kl_stopped_its_epochs_is_left_exactly_as_it_was():
    """Seed 1's advantages are all 0, so its policy never moves (KL 0) and it runs every epoch. Seeds 0 and 2
    pass a tiny target_kl once they have moved: the KL is measured on the forward pass before each step, so
    at the end of epoch 2. They must get no more Adam steps after that."""
    stack = ActorCriticStack([0, 1, 2], 4, 2)
    g = torch.Generator().manual_seed(1)
    obs, actions = torch.randn(3, 16, 4, generator=g), torch.randint(0, 2, (3, 16), generator=g)
    sampling_logprobs = stack.evaluate(obs, actions)[0].detach()  # pi_old is the stack as it is: KL starts at 0
    advantages = torch.randn(3, 16, generator=g) * torch.tensor([[1.0], [0.0], [1.0]])
    batch = PPOBatch(obs, actions, sampling_logprobs, advantages, torch.randn(3, 16, generator=g), torch.randn(3, 16))
    optimizer = _adam(stack)
    config = PPOConfig(update_epochs=4, target_kl=1e-12, ent_coef=0.0)
    epochs = _stack_update(stack, optimizer, batch, config, 0.2)
    assert epochs == [2, 4, 2]
    assert optimizer.steps == [2, 4, 2]


def test_stack_networks_are_the_modules_a_seed_would_build():
    stack = ActorCriticStack([3, 4], obs_dim=4, num_actions=2, hidden_sizes=(16, 8))
    obs = torch.randn(2, 10, 4)
    for s, (policy, value) in enumerate(stack.networks()):
        torch.manual_seed(3 + s)
        fresh_policy, fresh_value = CategoricalPolicy(4, 2, (16, 8)), ValueNet(4, (16, 8))
        assert torch.equal(_flat(policy), _flat(fresh_policy)) and torch.equal(_flat(value), _flat(fresh_value))
        # the stack's tanh is 2 sigmoid(2z) - 1 (see _mlp): equal to float32 rounding
        torch.testing.assert_close(stack.logits(obs)[s], policy.net(obs[s]), atol=1e-6, rtol=0)
        torch.testing.assert_close(stack.values(obs)[s], value(obs[s]), atol=1e-6, rtol=0)


def test_stack_update_matches_ppo_update_on_modules(float64):
    """The stack's update is the readable ppo_update (with torch's clip_grad_norm_ and Adam) on one seed."""
    g = torch.Generator().manual_seed(0)
    B = 64
    fields = dict(
        obs=torch.randn(B, 4, generator=g),
        actions=torch.randint(0, 2, (B,), generator=g),
        sampling_logprobs=-torch.rand(B, generator=g) - 0.3,
        advantages=torch.randn(B, generator=g),
        returns=torch.randn(B, generator=g),
        values=torch.randn(B, generator=g),
    )
    config = PPOConfig(update_epochs=5, ent_coef=0.01, clip_value=True, max_grad_norm=0.05)
    stack = ActorCriticStack([7], 4, 2)
    optimizer = RowAdam(stack.rows, lr=1e-2, eps=1e-5)
    _stack_update(stack, optimizer, PPOBatch(**{k: v[None] for k, v in fields.items()}), config, 0.2)
    torch.manual_seed(7)
    policy, value = CategoricalPolicy(4, 2), ValueNet(4)
    params = list(policy.parameters()) + list(value.parameters())
    ppo_update(policy, value, torch.optim.Adam(params, lr=1e-2, eps=1e-5, fused=True), PPOBatch(**fields), config, 0.2)
    ((p_stack, v_stack),) = stack.networks()
    assert not torch.allclose(_flat(p_stack), _flat(CategoricalPolicy(4, 2)))  # it did move
    torch.testing.assert_close(_flat(p_stack), _flat(policy), atol=1e-9, rtol=1e-7)
    torch.testing.assert_close(_flat(v_stack), _flat(value), atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_adam_is_torch_adam_bit_for_bit(dtype, fused):
    """RowAdam calls the fused kernel itself; its update must be torch.optim.Adam(fused=True)'s exactly, with rows
    skipped (grad None) on some steps, a changed lr, and after seeds leave (keep). Without the fused kernel (a
    device that lacks it) it must be torch's default Adam."""
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(40, generator=g, dtype=dtype) for _ in range(3)]
    grads = [[torch.randn(40, generator=g, dtype=dtype) for _ in range(3)] for _ in range(6)]
    ours = [x.clone().requires_grad_() for x in start]
    theirs = [x.clone().requires_grad_() for x in start]
    row_adam = RowAdam(ours, lr=1e-2, eps=1e-5, betas=(0.8, 0.99), fused=fused)
    torch_adam = torch.optim.Adam(theirs, lr=1e-2, eps=1e-5, betas=(0.8, 0.99), fused=fused or None)
    for t, step_grads in enumerate(grads):
        if t == 3:  # the seed at position 1 leaves
            ours, theirs = [ours[0], ours[2]], [theirs[0], theirs[2]]
            row_adam.keep([0, 2])
            state = torch_adam.state
            torch_adam = torch.optim.Adam(theirs, **torch_adam.defaults)
            for x in theirs:
                torch_adam.state[x] = state[x]
            step_grads = [step_grads[0], step_grads[2]]
        row_adam.lr = torch_adam.param_groups[0]["lr"] = 1e-2 * (1 - t / 6)
        row_adam.zero_grad()
        torch_adam.zero_grad()
        for i, (a, b, grad) in enumerate(zip(ours, theirs, step_grads)):
            if (t, i) not in ((1, 0), (2, 0), (4, 1)):  # these rows sit steps out
                a.grad, b.grad = grad.clone(), grad.clone()
        row_adam.step()
        torch_adam.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    assert row_adam.steps == [int(torch_adam.state[x]["step"]) for x in theirs] == [4, 5]


def test_keep_seeds_keeps_the_rows_and_their_adam_state():
    stack = ActorCriticStack([0, 1, 2], 4, 2)
    optimizer = RowAdam(stack.rows, lr=1e-3)
    for row, n in zip(stack.rows, (1, 2, 3)):
        for _ in range(n):
            row.grad = torch.ones_like(row)
            optimizer.step()
            optimizer.zero_grad()
    kept = [stack.rows[0], stack.rows[2]]
    optimizer = keep_seeds(stack, optimizer, [0, 2])
    assert stack.rows == kept and optimizer.rows == kept and stack.seeds == [0, 2]
    assert optimizer.steps == [1, 3]


def test_per_seed_clipping_is_torch_clipping_on_each_seed_alone(float64):
    torch.manual_seed(0)
    rows = [torch.zeros(50, requires_grad=True) for _ in range(3)]
    grads = [torch.randn(50) * scale for scale in (0.1, 3.0, 30.0)]  # one row below the limit, two above
    for row, grad in zip(rows, grads):
        row.grad = grad.clone()
    norms = clip_grad_norm_per_seed_(rows, 1.0)
    for row, grad, norm in zip(rows, grads, norms):
        alone = torch.nn.Parameter(torch.zeros(50))
        alone.grad = grad.clone()
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_([alone], 1.0))
        torch.testing.assert_close(row.grad, alone.grad)
    assert torch.equal(rows[0].grad, grads[0]) and rows[2].grad.norm() < 1.0 + 1e-9


def test_torch_cartpole_blocks_step_like_separate_envs():
    """Block g of a TorchCartPole reset with a list of seeds is a TorchCartPole of its own, resets included."""
    together = TorchCartPole(6, dtype=torch.float64)
    alone = [TorchCartPole(2, dtype=torch.float64) for _ in range(3)]
    obs, _ = together.reset(seed=[10, 11, 12])
    alone_obs = [env.reset(seed=10 + g)[0] for g, env in enumerate(alone)]
    g = torch.Generator().manual_seed(0)
    resets = 0
    for _ in range(200):
        assert torch.equal(obs, torch.cat(alone_obs))
        actions = torch.randint(0, 2, (6,), generator=g)
        obs, _, terminated, truncated, _ = together.step(actions)
        alone_obs = [env.step(actions[2 * i : 2 * i + 2])[0] for i, env in enumerate(alone)]
        resets += int((terminated | truncated).sum())
    assert resets > 6  # autoresets happened, and drew from each block's own generator
    with pytest.raises(ValueError, match="length divides num_envs"):
        TorchCartPole(5).reset(seed=[1, 2])


def test_update_fn_with_several_seeds_is_refused():
    with pytest.raises(ValueError, match="update_fn trains one seed at a time"):
        train_ppo(PPOConfig(num_seeds=2, progress=False), update_fn=ppo_update)
    with pytest.raises(ValueError, match="num_seeds must be a positive int"):
        PPOConfig(num_seeds=0)


def test_several_seeds_log_one_folder_each(tmp_path):
    train_ppo(
        PPOConfig(seed=2, num_seeds=2, total_steps=512, env_backend="torch", progress=False, log_dir=str(tmp_path))
    )
    assert (tmp_path / "seed2" / "metrics.jsonl").exists() and (tmp_path / "seed3" / "metrics.jsonl").exists()


@pytest.mark.cuda
def test_a_stack_trains_on_cuda():
    results = train_ppo(
        PPOConfig(
            seed=0,
            num_seeds=3,
            env_backend="torch",
            device="cuda",
            num_envs=64,
            total_steps=64 * 32 * 4,
            stop_when_solved=False,
            progress=False,
        )
    )
    assert all(next(r.policy.parameters()).device.type == "cuda" for r in results)
    assert all(len(r.updates) == 4 and len(r.episodes) > 0 for r in results)
    assert not torch.equal(_flat(results[0].policy), _flat(results[1].policy))


def test_a_stacked_seeds_config_names_the_folder_its_metrics_are_in(tmp_path):
    kw = dict(env_backend="torch", device="cpu", progress=False, total_steps=256, stop_when_solved=False)
    stacked = train_ppo(PPOConfig(seed=3, num_seeds=2, log_dir=str(tmp_path), **kw))
    for s, result in zip((3, 4), stacked):
        assert result.config.log_dir == f"{tmp_path}/seed{s}" and result.config.seed == s
        assert (tmp_path / f"seed{s}" / "metrics.jsonl").exists()


def test_a_solve_threshold_that_is_not_a_number_is_refused():
    with pytest.raises(ValueError, match="PPOConfig.solve_threshold must be a finite number, got nan"):
        PPOConfig(solve_threshold=float("nan"))


@pytest.mark.parametrize("trainer", ["ppo", "a2c", "reinforce_stack"])
def test_a_run_that_fails_to_start_keeps_the_last_runs_metrics(tmp_path, trainer):
    """SeedRuns opened each seed's metrics.jsonl (emptying it) before the env and the device were checked, so a
    misspelt env id or a missing GPU wiped the previous run's log."""
    from edurl import rl

    config = {
        "ppo": rl.PPOConfig(env_backend="torch", total_steps=512, num_seeds=2),
        "a2c": rl.A2CConfig(env_backend="torch", total_steps=512, num_seeds=2),
        "reinforce_stack": rl.ReinforceConfig(env_backend="torch", max_episodes=16, num_seeds=2),
    }[trainer]
    train = {"ppo": rl.train_ppo, "a2c": rl.train_a2c, "reinforce_stack": rl.train_reinforce}[trainer]
    config = replace(config, log_dir=str(tmp_path), progress=False)
    train(config)
    logs = [tmp_path / f"seed{s}" / "metrics.jsonl" for s in (0, 1)]
    before = [p.read_bytes() for p in logs]
    assert all(before)
    bad = [replace(config, device="cuda")] if not torch.cuda.is_available() else []
    if trainer != "reinforce_stack":
        bad.append(replace(config, env_backend="gymnasium", env_id="CartPole-v2"))
    if not bad:
        pytest.skip("REINFORCE's stack has no Gymnasium path to misspell, and this machine has CUDA")
    for broken in bad:
        with pytest.raises(Exception):  # noqa: B017 (gymnasium's and edurl's errors; what matters is the log)
            train(broken)
        assert [p.read_bytes() for p in logs] == before
