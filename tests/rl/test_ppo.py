import math

import pytest
import torch

from edurl import load_metrics
from edurl.objectives import clipped_surrogate_grad
from edurl.rl.networks import CategoricalPolicy, ValueNet
from edurl.rl.ppo import PPOBatch, PPOConfig, clipped_surrogate, ppo_diagnostics, ppo_update, train_ppo


def _loss_and_grad(ratio, adv, eps=0.2):
    logp = torch.tensor([math.log(ratio)], dtype=torch.float64, requires_grad=True)
    loss = clipped_surrogate(
        logp, torch.zeros(1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64), 1 - eps, 1 + eps
    )
    loss.sum().backward()
    return loss.item(), logp.grad.item()


@pytest.mark.parametrize(
    "ratio, adv, loss, grad",
    [
        # inside [0.8, 1.2]: loss = -r*A, d loss / d logp = -r*A
        (1.0, 2.0, -2.0, -2.0),
        (0.9, -1.0, 0.9, 0.9),
        # A > 0, r above 1 + eps: the clipped term 1.2*A is the min; no gradient
        (1.5, 2.0, -2.4, 0.0),
        # A > 0, r below 1 - eps: the unclipped r*A is the min; gradient flows
        (0.5, 2.0, -1.0, -1.0),
        # A < 0, r below 1 - eps: the clipped 0.8*A is the min (of two negatives, the smaller); no gradient
        (0.5, -1.0, 0.8, 0.0),
        # A < 0, r above 1 + eps: unclipped r*A is the min; gradient flows (the "undo" direction is not clipped)
        (1.5, -1.0, 1.5, 1.5),
    ],
)
def test_clipped_surrogate_hand_values_and_gradients(ratio, adv, loss, grad):
    got_loss, got_grad = _loss_and_grad(ratio, adv)
    assert got_loss == pytest.approx(loss) and got_grad == pytest.approx(grad)
    # the closed form that the seed stack's hand-written backward uses
    logp = torch.tensor([math.log(ratio)], dtype=torch.float64)
    closed = clipped_surrogate_grad(logp, torch.zeros(1, dtype=torch.float64), torch.tensor([adv]).double(), 0.8, 1.2)
    assert closed.item() == pytest.approx(grad)


@pytest.mark.parametrize("adv", [2.0, -1.5, 0.0])
def test_clipped_surrogate_grad_on_the_clip_boundary_is_autograds(adv):
    """At r == lo == hi (r = 1, a zero-width range) both terms of the min tie and the clamp lets the gradient
    through: autograd's gradient is the whole -r * A, and so is the closed form."""
    logp = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([adv], dtype=torch.float64)
    clipped_surrogate(logp, torch.zeros(1, dtype=torch.float64), advantages, 1.0, 1.0).sum().backward()
    closed = clipped_surrogate_grad(logp.detach(), torch.zeros(1, dtype=torch.float64), advantages, 1.0, 1.0)
    assert logp.grad.item() == closed.item() == -adv


def test_diagnostics_hand_computed():
    old = torch.zeros(2)
    new = torch.log(torch.tensor([1.5, 0.9]))
    k1, k3, clip = ppo_diagnostics(new, old, 0.2)
    # k1 = mean(-log r); k3 = mean(r - 1 - log r); one of two ratios is outside [0.8, 1.2]
    assert k1.item() == pytest.approx(-(math.log(1.5) + math.log(0.9)) / 2)
    assert k3.item() == pytest.approx(((0.5 - math.log(1.5)) + (-0.1 - math.log(0.9))) / 2)
    assert clip.item() == 0.5


def test_k1_and_k3_estimate_the_kl_on_an_exact_distribution():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)  # pi_old, which sampled the actions
    q = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)  # the new policy
    exact = (p * (p / q).log()).sum()
    log_ratio = (q / p).log()
    k1 = (p * -log_ratio).sum()
    k3 = (p * (log_ratio.exp() - 1 - log_ratio)).sum()
    torch.testing.assert_close(k1, exact)
    torch.testing.assert_close(k3, exact)


@pytest.mark.parametrize("backend", ["gymnasium", "torch"])
def test_ppo_learns_and_logs_diagnostics(tmp_path, backend):
    result = train_ppo(
        PPOConfig(
            seed=0,
            env_backend=backend,
            total_steps=12_800,
            stop_when_solved=False,
            progress=False,
            log_dir=str(tmp_path),
        )
    )
    returns = result.episodes["episode_return"].to_numpy()
    assert returns[-20:].mean() > 4 * returns[:20].mean()
    u = result.updates
    assert len(u) == 50 and {"approx_kl_k1", "approx_kl_k3", "clip_fraction", "explained_variance"} <= set(u.columns)
    assert (u["approx_kl_k3"] >= 0).all() and u["clip_fraction"].between(0, 1).all()
    assert (
        u["learning_rate"].iloc[0] == pytest.approx(1e-3) and u["learning_rate"].iloc[-1] < u["learning_rate"].iloc[0]
    )  # annealed
    assert "optim/clip_fraction" in load_metrics(tmp_path)


def test_target_kl_stops_epochs_early():
    result = train_ppo(PPOConfig(seed=0, total_steps=2560, target_kl=1e-6, stop_when_solved=False, progress=False))
    assert (result.updates["epochs"] < 20).all()


def test_bad_backend():
    with pytest.raises(ValueError, match="env_backend"):
        train_ppo(PPOConfig(env_backend="jax", progress=False))
    with pytest.raises(ValueError, match="only CartPole-v1"):
        train_ppo(PPOConfig(env_backend="torch", env_id="Acrobot-v1", progress=False))


@pytest.mark.cuda
def test_ppo_on_cuda_with_torch_env():
    result = train_ppo(
        PPOConfig(
            seed=0,
            env_backend="torch",
            device="cuda",
            num_envs=64,
            total_steps=8192,
            stop_when_solved=False,
            progress=False,
        )
    )
    assert next(result.policy.parameters()).device.type == "cuda" and len(result.episodes) > 0


def _tiny_batch(size=12):
    g = torch.Generator().manual_seed(0)
    return PPOBatch(
        obs=torch.randn(size, 4, generator=g),
        actions=torch.randint(0, 2, (size,), generator=g),
        sampling_logprobs=-torch.rand(size, generator=g),
        advantages=torch.randn(size, generator=g),
        returns=torch.randn(size, generator=g),
        values=torch.randn(size, generator=g),
    )


def test_minibatches_cover_the_batch_once_per_epoch():
    batch = _tiny_batch(12)
    assert list(batch.minibatches(1)) == [slice(None)]
    parts = list(batch.minibatches(3))
    assert [len(p) for p in parts] == [4, 4, 4]
    assert sorted(torch.cat(parts).tolist()) == list(range(12))
    with pytest.raises(ValueError, match="must divide the batch size"):
        list(batch.minibatches(5))


def test_ppo_update_one_step_equals_the_loss_written_out():
    """One epoch, one minibatch: the step's gradient is that of the clipped loss + value loss - entropy bonus."""
    batch = _tiny_batch(12)
    torch.manual_seed(0)
    policy, value = CategoricalPolicy(4, 2, (8,)), ValueNet(4, (8,))
    config = PPOConfig(update_epochs=1, num_minibatches=1, ent_coef=0.01, max_grad_norm=1e9)
    params = [*policy.parameters(), *value.parameters()]
    # the loss by hand, at the starting weights
    dist = policy(batch.obs)
    lp = dist.log_prob(batch.actions)
    adv = (batch.advantages - batch.advantages.mean()) / (batch.advantages.std() + 1e-8)
    ratio = (lp - batch.sampling_logprobs).exp()
    loss = (
        -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        + 0.5 * 0.5 * ((value(batch.obs) - batch.returns) ** 2).mean()
        - 0.01 * dist.entropy().mean()
    )
    expected = torch.autograd.grad(loss, params)
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=1.0)
    assert ppo_update(policy, value, optimizer, batch, config, 0.2) == 1
    for p, b, g in zip(params, before, expected):
        torch.testing.assert_close(b - p.detach(), g)  # SGD with lr 1: the step is the gradient


def test_train_ppo_takes_an_update_fn():
    """The worked solution of exercise 5.3 trains like the library's update; a do-nothing update learns nothing."""
    from edurl.exercises.solutions.ch05 import ppo_update as learners

    config = PPOConfig(seed=0, env_backend="torch", total_steps=2560, stop_when_solved=False, progress=False)
    ours, theirs = train_ppo(config), train_ppo(config, update_fn=learners)
    torch.testing.assert_close(
        ours.episodes["episode_return"].to_numpy()[:20], theirs.episodes["episode_return"].to_numpy()[:20]
    )
    frozen = train_ppo(config, update_fn=lambda *args: 0)
    # the policy never moves: its KL to itself is 0 up to the rounding of a forward pass over another batch shape
    # (the rollout scores num_envs states at a time, the diagnostics the whole batch; CI once saw -2.3e-10)
    assert (frozen.updates["approx_kl_k3"].abs() < 1e-8).all() and (frozen.updates["epochs"] == 0).all()


def test_diagnostics_are_measured_after_the_update():
    result = train_ppo(PPOConfig(seed=0, env_backend="torch", total_steps=1024, stop_when_solved=False, progress=False))
    assert (result.updates["approx_kl_k3"] > 0).all() and (result.updates["epochs"] == 20).all()
