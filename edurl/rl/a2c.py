"""Advantage actor-critic (A2C; Mnih et al., 2016, synchronous variant) with GAE advantages. Chapter 3.

Each update: collect T steps from N envs (same-step autoreset, true final observations kept),
compute GAE(lambda) advantages with termination and truncation kept apart (Chapter 4), then take
one gradient step on

    loss = -mean(log pi(a_t|s_t) * A_t)  +  vf_coef * 0.5 * mean((V(s_t) - R_t)^2)  -  ent_coef * mean(entropy)

where R_t = A_t + V(s_t) are the GAE value targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import edurl
from edurl._checks import check_fields
from edurl.metrics import MetricsLogger
from edurl.rl.advantages import gae
from edurl.rl.episodes import EpisodeLog, TrainerConfig, TrainResult
from edurl.rl.networks import CategoricalPolicy, ValueNet
from edurl.rl.rollout import collect_rollout, make_vector_env
from edurl.utils import progress, torch_threads

__all__ = ["A2CConfig", "train_a2c"]


@dataclass
class A2CConfig(TrainerConfig):
    num_envs: int = 8
    """Environments stepped in parallel (N)."""
    num_steps: int = 64
    """Steps per env per update (T); a batch holds N*T transitions."""
    gamma: float = 0.99
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda: 0 = one-step TD errors, 1 = Monte Carlo returns minus V."""
    learning_rate: float = 2.5e-3
    """Adam learning rate (policy and value together)."""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the policy and value MLPs."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    max_grad_norm: float = 0.5
    """Clip the global gradient norm to this."""
    normalize_advantages: bool = True
    """Standardise advantages over the batch before the policy loss."""
    total_steps: int = 300_000
    """Stop after this many env steps."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            positive_int=("num_envs", "num_steps", "total_steps"),
            unit=("gamma", "lam"),
            nonneg=("learning_rate", "vf_coef", "ent_coef"),
            positive=("max_grad_norm",),
            sizes=("hidden_sizes",),
        )


def train_a2c(config: A2CConfig, losses_fn=None) -> TrainResult:
    """Train with A2C + GAE until solved (or ``total_steps``). See ``A2CConfig``.

    ``losses_fn(logprobs, returns, values) -> (policy_loss, value_loss)`` is Chapter 3's exercise 3.1
    (REINFORCE with a learned baseline) driving A2C: the policy loss comes from it with the GAE advantages
    (standardised when ``config.normalize_advantages``) as ``returns - values``, and the value loss with the
    GAE targets as ``returns``. Its results equal the built-in losses' up to float rounding (``returns - values``
    is formed from a sum), so a seed's run follows another trajectory than without it.
    """
    with torch_threads(config.num_threads, config.device):
        return _train(config, losses_fn)


def _train(config: A2CConfig, losses_fn=None) -> TrainResult:
    log = EpisodeLog(config)  # its clock starts here: setup counts toward time-to-solve
    edurl.seed_everything(config.seed)
    device = edurl.device(config.device)
    envs = make_vector_env(config.env_id, config.num_envs)
    obs, _ = envs.reset(seed=config.seed)
    obs_dim, num_actions = envs.single_observation_space.shape[0], envs.single_action_space.n
    policy = CategoricalPolicy(obs_dim, num_actions, config.hidden_sizes).to(device)
    value = ValueNet(obs_dim, config.hidden_sizes).to(device)
    params = list(policy.parameters()) + list(value.parameters())
    optimizer = torch.optim.Adam(params, lr=config.learning_rate)
    logger = MetricsLogger(config.log_dir, if_exists="overwrite") if config.log_dir else None

    counter, env_steps = None, 0
    bar = progress(total=config.total_steps, desc="A2C env steps", disable=not config.progress)
    while env_steps < config.total_steps:
        ro, obs, counter = collect_rollout(envs, policy, obs, config.num_steps, device, counter)
        values = value(ro.obs)  # (T, N), with grad for the value loss
        with torch.no_grad():
            next_values = value(ro.next_obs)  # V(true s_{t+1}); zeroed by gae() where terminated
        advantages, returns = gae(
            ro.rewards, values.detach(), next_values, ro.terminated, ro.truncated, config.gamma, config.lam
        )
        dist = policy(ro.obs)
        adv = advantages.flatten()
        if config.normalize_advantages:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        logprobs = dist.log_prob(ro.actions).flatten()
        if losses_fn is None:
            policy_loss = -(logprobs * adv).mean()
            value_loss = 0.5 * ((values - returns) ** 2).mean()
        else:  # the learner's exercise 3.1: its policy loss on the advantages, its value loss on the targets
            v = values.detach().flatten()
            policy_loss, _ = losses_fn(logprobs, v + adv, v)
            _, value_loss = losses_fn(logprobs.detach(), returns.flatten(), values.flatten())
        entropy = dist.entropy().mean()
        loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        optimizer.step()

        env_steps += config.num_steps * config.num_envs
        log.add(ro.episode_returns, ro.episode_lengths, env_steps)
        if logger:
            logger.log(
                env_steps,
                **{
                    "episodes": len(log),
                    "optim/policy_loss": policy_loss.item(),
                    "optim/value_loss": value_loss.item(),
                    "optim/entropy": entropy.item(),
                    "time/total": log.elapsed(),
                },
            )
        bar.update(config.num_steps * config.num_envs)
        bar.set_postfix(mean_return=f"{log.recent_mean():.0f}", refresh=False)
        if ro.episode_returns and log.should_stop():
            break
    bar.close()
    envs.close()
    if logger:
        logger.close()
    return log.result(policy, value)
