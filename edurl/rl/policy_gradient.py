"""Measuring policy gradients: the score-function estimator on a bandit (Chapter 2) and the
variance of REINFORCE's gradient with and without baselines (Chapter 3).

The log-derivative trick: grad E_{a~pi}[r(a)] = E_{a~pi}[grad log pi(a) * r(a)]. Its right-hand side
can be estimated from samples alone, which is what makes policy gradients work without a model.
"""

from __future__ import annotations

import gymnasium as gym
import torch

from edurl.rl.networks import ValueNet, module_device
from edurl.rl.returns import discounted_returns
from edurl.rl.rollout import EpisodeBatch, collect_episodes
from edurl.utils import progress as progress_bar
from edurl.utils import torch_threads

__all__ = [
    "bandit_exact_gradient",
    "bandit_gradient_samples",
    "flat_policy_gradient",
    "fit_value_baseline",
    "gradient_variance",
]


def bandit_exact_gradient(logits: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """grad_theta J for a softmax policy over K arms, J = sum_a softmax(theta)_a * mean_a, by autograd. (K,)"""
    theta = logits.detach().clone().requires_grad_(True)
    (torch.softmax(theta, -1) * means).sum().backward()
    return theta.grad


def bandit_gradient_samples(
    logits: torch.Tensor,
    means: torch.Tensor,
    stds: torch.Tensor,
    num_samples: int,
    baseline: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One score-function estimate per sample: grad log pi(a) * (r - baseline), shape (num_samples, K).

    a ~ softmax(logits), r ~ Normal(means[a], stds[a]). For a softmax, grad_theta log pi(a) = onehot(a) - pi
    (a test checks this against autograd). Their mean estimates :func:`bandit_exact_gradient`.
    """
    probs = torch.softmax(logits.detach(), -1)
    actions = torch.multinomial(probs, num_samples, replacement=True, generator=generator)  # (S,)
    noise = torch.randn(num_samples, generator=generator, dtype=means.dtype, device=means.device)  # (S,)
    rewards = means[actions] + stds[actions] * noise
    score = torch.nn.functional.one_hot(actions, len(probs)).to(probs.dtype) - probs  # (S, K)
    return score * (rewards - baseline)[:, None]


def flat_policy_gradient(policy: torch.nn.Module, batch: EpisodeBatch, weights: torch.Tensor) -> torch.Tensor:
    """grad_theta of (1/episodes) * sum_t log pi(a_t|s_t) * w_t over the batch's real steps, flattened to (P,)."""
    logprobs = policy(batch.obs[batch.mask]).log_prob(batch.actions[batch.mask])
    objective = (logprobs * weights[batch.mask].detach()).sum() / batch.mask.shape[1]
    grads = torch.autograd.grad(objective, list(policy.parameters()))
    return torch.cat([g.flatten() for g in grads])


def fit_value_baseline(
    policy: torch.nn.Module,
    env_id: str,
    num_episodes: int,
    gamma: float,
    *,
    steps: int = 500,
    learning_rate: float = 3e-3,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> ValueNet:
    """Regress a fresh ValueNet on the reward-to-go of ``num_episodes`` episodes of ``policy`` (kept fixed).
    ``device`` defaults to the policy's."""
    device = module_device(policy) if device is None else torch.device(device)
    with torch_threads(1):  # small nets: fastest, and repeatable across machines, on one thread
        envs = [gym.make(env_id) for _ in range(num_episodes)]
        batch = collect_episodes(envs, policy.act, device, seeds=[seed + i for i in range(num_episodes)])
        G = discounted_returns(batch.rewards, batch.dones, gamma)[batch.mask]
        obs = batch.obs[batch.mask]
        value = ValueNet(obs.shape[-1]).to(device)
        opt = torch.optim.Adam(value.parameters(), lr=learning_rate)
        for _ in range(steps):
            loss = ((value(obs) - G) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return value


def gradient_variance(
    policy: torch.nn.Module,
    env_id: str,
    baselines: dict,
    *,
    num_batches: int = 100,
    episodes_per_batch: int = 4,
    gamma: float = 0.99,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Per-batch REINFORCE gradients at a fixed policy, for each baseline, on the *same* batches.

    ``baselines`` maps a name to a function ``(obs (B, obs_dim), G (B,)) -> b (B,)`` of precomputed,
    fixed quantities: ``lambda obs, G: 0`` (none), a constant, or a value network's V(s). Returns
    name -> (num_batches, P) gradients. The total variance is ``grads.var(0).sum()``. ``device`` defaults to the
    policy's.
    """
    device = module_device(policy) if device is None else torch.device(device)
    with torch_threads(1):  # small nets: fastest, and repeatable across machines, on one thread
        envs = [gym.make(env_id) for _ in range(episodes_per_batch)]
        out = {name: [] for name in baselines}
        for k in progress_bar(range(num_batches), desc="gradient batches", disable=not progress):
            batch = collect_episodes(
                envs, policy.act, device, seeds=[seed + k * episodes_per_batch + i for i in range(episodes_per_batch)]
            )
            G = discounted_returns(batch.rewards, batch.dones, gamma)
            for name, baseline in baselines.items():
                with torch.no_grad():
                    b = torch.zeros_like(G)
                    b[batch.mask] = torch.as_tensor(
                        baseline(batch.obs[batch.mask], G[batch.mask]), dtype=G.dtype, device=G.device
                    )
                out[name].append(flat_policy_gradient(policy, batch, G - b))
        return {name: torch.stack(grads) for name, grads in out.items()}
