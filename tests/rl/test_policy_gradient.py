import gymnasium as gym
import pytest
import torch

from edurl.rl import CategoricalPolicy, collect_episodes
from edurl.rl.policy_gradient import (
    bandit_exact_gradient,
    bandit_gradient_samples,
    fit_value_baseline,
    flat_policy_gradient,
    gradient_variance,
)


def test_bandit_exact_gradient_hand_computed():
    # pi = (1/2, 1/2), means (1, 3): dJ/dtheta_a = pi_a (mean_a - pi . means) = 0.5 * (1 - 2), 0.5 * (3 - 2)
    g = bandit_exact_gradient(torch.zeros(2), torch.tensor([1.0, 3.0]))
    torch.testing.assert_close(g, torch.tensor([-0.5, 0.5]))


def test_softmax_score_is_onehot_minus_pi():
    logits = torch.tensor([0.3, -1.0, 0.5], requires_grad=True)
    torch.log_softmax(logits, -1)[2].backward()
    torch.testing.assert_close(logits.grad, torch.tensor([0.0, 0.0, 1.0]) - torch.softmax(logits.detach(), -1))


def test_score_function_estimate_is_unbiased():
    logits, means, stds = (
        torch.tensor([0.2, -0.4], dtype=torch.float64),
        torch.tensor([1.0, 2.0], dtype=torch.float64),
        torch.tensor([1.0, 0.5], dtype=torch.float64),
    )
    exact = bandit_exact_gradient(logits, means)
    samples = bandit_gradient_samples(logits, means, stds, 200_000, generator=torch.Generator().manual_seed(0))
    se = samples.std(0) / 200_000**0.5
    assert ((samples.mean(0) - exact).abs() < 4 * se).all()
    # a constant baseline changes the variance, not the mean
    with_b = bandit_gradient_samples(
        logits, means, stds, 200_000, baseline=1.5, generator=torch.Generator().manual_seed(1)
    )
    assert ((with_b.mean(0) - exact).abs() < 4 * with_b.std(0) / 200_000**0.5).all()
    assert with_b.var(0).sum() < samples.var(0).sum()


def test_flat_policy_gradient_matches_manual_sum():
    torch.manual_seed(0)
    policy = CategoricalPolicy(4, 2)
    batch = collect_episodes([gym.make("CartPole-v1") for _ in range(2)], policy.act, torch.device("cpu"), seeds=[0, 1])
    w = torch.randn(batch.rewards.shape)
    flat = flat_policy_gradient(policy, batch, w)
    policy.zero_grad()
    total = 0
    for n in range(2):
        for t in range(int(batch.lengths[n])):
            total = total + policy(batch.obs[t, n][None]).log_prob(batch.actions[t, n][None])[0] * w[t, n]
    (total / 2).backward()
    manual = torch.cat([p.grad.flatten() for p in policy.parameters()])
    torch.testing.assert_close(flat, manual, atol=1e-5, rtol=1e-4)


def test_gradient_variance_same_batches_for_every_baseline():
    torch.manual_seed(0)
    policy = CategoricalPolicy(4, 2)
    out = gradient_variance(
        policy,
        "CartPole-v1",
        {"none": lambda o, G: 0.0, "constant": lambda o, G: 15.0},
        num_batches=30,
        episodes_per_batch=4,
        progress=False,
    )
    P = sum(p.numel() for p in policy.parameters())
    assert out["none"].shape == (30, P) and out["constant"].shape == (30, P)
    assert out["constant"].var(0).sum() < out["none"].var(0).sum()


@pytest.mark.cuda
def test_the_variance_helpers_default_to_the_policys_device():
    # their device used to default to "cpu", so a GPU-trained policy met CPU observations
    torch.manual_seed(0)
    policy = CategoricalPolicy(4, 2).cuda()
    value = fit_value_baseline(policy, "CartPole-v1", 2, 0.99, steps=2)
    assert next(value.parameters()).device.type == "cuda"
    grads = gradient_variance(policy, "CartPole-v1", {"none": lambda obs, G: 0}, num_batches=2, progress=False)
    assert grads["none"].shape[0] == 2
