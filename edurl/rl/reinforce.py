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
from edurl.rl.rollout import EpisodeBatch, collect_episodes
from edurl.utils import progress, torch_threads

__all__ = ["ReinforceConfig", "reinforce_loss", "reinforce_update", "train_reinforce"]


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


@torch.no_grad()
def _entropy_after(policy: CategoricalPolicy, batch: EpisodeBatch) -> float:
    """Mean entropy of the (updated) policy on the batch's real states."""
    return policy(batch.obs[batch.mask]).entropy().mean().item()


def reinforce_update(
    policy: CategoricalPolicy,
    optimizer: torch.optim.Optimizer,
    envs: list[gym.Env],
    seeds: list[int],
    gamma: float,
    device: torch.device,
    *,
    loss_fn=None,
    normalize_advantages: bool = True,
    value: ValueNet | None = None,
    value_optimizer: torch.optim.Optimizer | None = None,
) -> tuple[EpisodeBatch, torch.Tensor]:
    """One REINFORCE update, the whole algorithm once: returns (the episodes, the loss).

    1. play one fresh episode in each env (env i reset with ``seeds[i]``) with the current policy;
    2. the reward-to-go G_t of every step (Chapter 1), then keep the real steps (padding has mask 0);
    3. the surrogate loss -mean(log pi(a_t | s_t) * weight_t) (exercise 2.1);
    4. one optimizer step on it.

    Exercise 2.2 is this function with its first six arguments. The keyword arguments are what
    ``train_reinforce`` adds: ``loss_fn(logprobs, weights)`` instead of ``reinforce_loss``, and a learned
    baseline (Chapter 3): ``value`` regresses on G_t with ``value_optimizer`` and the weights become G_t - V(s_t).
    """
    batch = collect_episodes(envs, policy.act, device, seeds=seeds)  # 1. (T, N) tensors, padded
    returns = discounted_returns(batch.rewards, batch.dones, gamma)  # 2. (T, N)
    obs, actions, G = batch.obs[batch.mask], batch.actions[batch.mask], returns[batch.mask]  # (B, ...)
    weights = G
    if value is not None:
        # Baseline: weights G_t - V(s_t); V regresses on G_t (Chapter 3).
        v = value(obs)
        value_loss = 0.5 * ((v - G) ** 2).mean()
        value_optimizer.zero_grad()
        value_loss.backward()
        value_optimizer.step()
        weights = G - v.detach()
    logprobs = policy(obs).log_prob(actions)  # 3. (B,), with gradient
    loss = loss_fn(logprobs, weights) if loss_fn else reinforce_loss(logprobs, weights, normalize_advantages)
    optimizer.zero_grad()  # 4. (without it, gradients of earlier updates would add up)
    loss.backward()
    optimizer.step()
    return batch, loss


def train_reinforce(config: ReinforceConfig, loss_fn=None, update_fn=None) -> TrainResult:
    """Train a policy with REINFORCE until solved (or ``max_episodes``). See ``ReinforceConfig``.

    ``loss_fn(logprobs, weights) -> scalar`` replaces the surrogate loss, e.g. with your own from
    exercise 2.1 (it should normalise the weights itself). By default it is ``reinforce_loss`` with
    ``config.normalize_advantages``.

    ``update_fn(policy, optimizer, envs, seeds, gamma, device) -> (batch, loss)`` replaces the whole
    update, e.g. with your own from exercise 2.2; it has no learned baseline, so it needs
    ``baseline="none"``, and it computes its own loss, so it cannot be given with ``loss_fn``.
    """
    if update_fn is not None and config.baseline != "none":
        raise ValueError(
            f"update_fn replaces the whole update, which has no learned baseline, but baseline={config.baseline!r}: "
            "use ReinforceConfig(baseline='none') with update_fn."
        )
    if update_fn is not None and loss_fn is not None:
        raise ValueError("update_fn computes its own loss: pass update_fn or loss_fn, not both.")
    with torch_threads(config.num_threads, config.device):
        return _train(config, loss_fn, update_fn)


def _train(config: ReinforceConfig, loss_fn, update_fn) -> TrainResult:
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
        first_seed = config.seed * 1_000_003 + len(log)
        seeds = [first_seed + i for i in range(len(envs))]
        if update_fn is not None:
            batch, loss = update_fn(policy, optimizer, envs, seeds, config.gamma, device)
        else:
            batch, loss = reinforce_update(
                policy,
                optimizer,
                envs,
                seeds,
                config.gamma,
                device,
                loss_fn=loss_fn,
                normalize_advantages=config.normalize_advantages,
                value=value,
                value_optimizer=value_opt,
            )

        env_steps += int(batch.mask.sum())
        log.add(batch.episode_returns.tolist(), batch.lengths.tolist(), env_steps)
        if logger:
            logger.log(
                env_steps,
                **{
                    "episodes": len(log),
                    "env/episode_return_mean": float(batch.episode_returns.mean()),
                    "optim/policy_loss": float(loss),
                    "optim/entropy": _entropy_after(policy, batch),
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
