"""REINFORCE (Williams, 1992) with reward-to-go and an optional learned baseline. Chapters 2 and 3.

The policy gradient theorem (Sutton et al., 2000) gives

    grad J(theta) = E[ sum_t grad log pi_theta(a_t | s_t) * G_t ],

so minimising  -mean_t( log pi(a_t | s_t) * A_t )  with A_t = G_t (or G_t - b(s_t)) climbs J.
Each update here uses ``episodes_per_update`` complete, fresh episodes: exact returns, strictly on-policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import torch

import edurl
from edurl._checks import check_fields
from edurl.metrics import MetricsLogger
from edurl.rl.episodes import EpisodeLog, TrainerConfig, TrainResult
from edurl.rl.networks import CategoricalPolicy, ValueNet
from edurl.rl.returns import discounted_returns
from edurl.rl.rollout import collect_episodes
from edurl.utils import progress, torch_threads

__all__ = ["ReinforceConfig", "reinforce_loss", "train_reinforce"]


@dataclass
class ReinforceConfig(TrainerConfig):
    episodes_per_update: int = 8
    """Complete episodes collected (in parallel, one per env) for each gradient step."""
    gamma: float = 0.99
    """Discount factor for the reward-to-go."""
    learning_rate: float = 0.01
    """Adam learning rate of the policy."""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the policy (and value) MLPs."""
    normalize_advantages: bool = True
    """Standardise the weights A_t over the batch (subtract mean, divide by std)."""
    baseline: str = "none"
    """"none": weight by G_t. "value": weight by G_t - V(s_t), with V learned by regression on G_t."""
    value_learning_rate: float = 0.01
    """Adam learning rate of the value baseline (only with baseline="value")."""
    max_episodes: int = 3000
    """Stop after this many training episodes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            positive_int=("episodes_per_update", "max_episodes"),
            unit=("gamma",),
            nonneg=("learning_rate", "value_learning_rate"),
            sizes=("hidden_sizes",),
            choices={"baseline": ("none", "value")},
        )


def reinforce_loss(logprobs: torch.Tensor, weights: torch.Tensor, normalize_advantages: bool = True) -> torch.Tensor:
    """Surrogate loss whose gradient is the (negated) REINFORCE estimator.

    ``logprobs`` (B,) log pi(a_t | s_t) with grad; ``weights`` (B,) returns or advantages (no grad is
    taken through them). With ``normalize_advantages``, weights become (w - mean) / (std + 1e-8) first: a batch
    baseline plus a fixed step scale. Returns -mean(logprobs * weights), a scalar.
    """
    if logprobs.shape != weights.shape or logprobs.dim() != 1:
        raise ValueError(
            f"logprobs and weights must both be 1-D of the same length, got "
            f"{tuple(logprobs.shape)} and {tuple(weights.shape)}; flatten the valid steps first."
        )
    weights = weights.detach()
    if normalize_advantages:
        weights = (weights - weights.mean()) / (weights.std() + 1e-8) if weights.numel() > 1 else weights * 0
    return -(logprobs * weights).mean()


def train_reinforce(config: ReinforceConfig, loss_fn=None) -> TrainResult:
    """Train a policy with REINFORCE until solved (or ``max_episodes``). See ``ReinforceConfig``.

    ``loss_fn(logprobs, weights) -> scalar`` replaces the surrogate loss, e.g. with your own from
    exercise 2.1 (it should normalise the weights itself). By default it is ``reinforce_loss`` with
    ``config.normalize_advantages``.
    """
    if config.baseline not in ("none", "value"):
        raise ValueError(f"baseline must be 'none' or 'value', got {config.baseline!r}.")
    with torch_threads(config.num_threads, config.device):
        return _train(config, loss_fn)


def _train(config: ReinforceConfig, loss_fn) -> TrainResult:
    log = EpisodeLog(config)  # its clock starts here: setup counts toward time-to-solve
    edurl.seed_everything(config.seed)
    device = edurl.device(config.device)
    envs = [gym.make(config.env_id) for _ in range(config.episodes_per_update)]
    obs_dim, num_actions = envs[0].observation_space.shape[0], envs[0].action_space.n
    policy = CategoricalPolicy(obs_dim, num_actions, config.hidden_sizes).to(device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=config.learning_rate)
    value = value_opt = None
    if config.baseline == "value":
        value = ValueNet(obs_dim, config.hidden_sizes).to(device)
        value_opt = torch.optim.Adam(value.parameters(), lr=config.value_learning_rate)
    logger = MetricsLogger(config.log_dir, if_exists="overwrite") if config.log_dir else None

    env_steps = 0
    bar = progress(total=config.max_episodes, desc="REINFORCE episodes", disable=not config.progress)
    while len(log) < config.max_episodes:
        # 1. Sample fresh episodes with the current policy.
        first_seed = config.seed * 1_000_003 + len(log)
        batch = collect_episodes(envs, policy.act, device, seeds=[first_seed + i for i in range(len(envs))])
        # 2. Reward-to-go for every real step (padding has reward 0 and sits after a done).
        returns = discounted_returns(batch.rewards, batch.dones, config.gamma)  # (T, N)
        obs, acts, G = batch.obs[batch.mask], batch.actions[batch.mask], returns[batch.mask]  # (B, ...)
        weights = G
        if value is not None:
            # Baseline: weights G_t - V(s_t); V regresses on G_t (Chapter 3).
            v = value(obs)
            value_loss = 0.5 * ((v - G) ** 2).mean()
            value_opt.zero_grad()
            value_loss.backward()
            value_opt.step()
            weights = G - v.detach()
        # 3. One gradient step on the surrogate loss.
        dist = policy(obs)
        logprobs = dist.log_prob(acts)
        loss = loss_fn(logprobs, weights) if loss_fn else reinforce_loss(logprobs, weights, config.normalize_advantages)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        env_steps += int(batch.mask.sum())
        log.add(batch.episode_returns.tolist(), batch.lengths.tolist(), env_steps)
        if logger:
            logger.log(
                env_steps,
                **{
                    "episodes": len(log),
                    "env/episode_return_mean": float(batch.episode_returns.mean()),
                    "optim/policy_loss": loss.item(),
                    "optim/entropy": dist.entropy().mean().item(),
                    "time/total": log.elapsed(),
                },
            )
        bar.update(len(batch.lengths))
        bar.set_postfix(mean_return=f"{log.recent_mean():.0f}", refresh=False)
        if log.should_stop():
            break
    bar.close()
    if logger:
        logger.close()
    return log.result(policy, value)
