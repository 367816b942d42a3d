"""Proximal Policy Optimization with the clipped surrogate (Schulman et al., 2017). Chapter 5.

Each update collects T steps from N envs, computes GAE(lambda) advantages (Chapter 4), then reuses the
batch for several epochs of minibatch steps on

    L = -mean( min(r * A, clip(r, 1 - eps, 1 + eps) * A) ) + vf_coef * L_V - ent_coef * H,
    r = pi_theta(a|s) / pi_old(a|s) = exp(train_logprob - sampling_logprob),

where pi_old is the policy that collected the batch. The clip removes the incentive to move r outside
[1 - eps, 1 + eps], which is what makes the reuse safe. Implementation details that matter carry a
"detail" comment and are explained, with their sources, in chapters/05_ppo.md (Huang et al., 2022;
Engstrom et al., 2020).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pandas as pd
import torch

import edurl
from edurl._checks import check_fields
from edurl.metrics import MetricsLogger
from edurl.objectives import clip_fraction, clipped_surrogate
from edurl.rl.advantages import gae
from edurl.rl.episodes import EpisodeLog, TrainerConfig, TrainResult
from edurl.rl.networks import CategoricalPolicy, ValueNet
from edurl.rl.rollout import collect_rollout, make_vector_env
from edurl.utils import progress, torch_threads

__all__ = ["PPOBatch", "PPOConfig", "collect_batch", "make_env", "ppo_diagnostics", "ppo_update", "train_ppo"]


@dataclass
class PPOConfig(TrainerConfig):
    env_backend: str = "gymnasium"
    """"gymnasium": a same-step-autoreset Gymnasium vector env. "torch": edurl.envs.TorchCartPole on `device`."""
    num_envs: int = 8
    """Environments stepped in parallel (N)."""
    num_steps: int = 32
    """Steps per env per rollout (T); a batch holds N*T transitions."""
    num_minibatches: int = 1
    """Minibatches the batch is split into for each epoch."""
    update_epochs: int = 20
    """Passes over the batch per rollout."""
    gamma: float = 0.98
    """Discount factor."""
    lam: float = 0.8
    """GAE lambda."""
    learning_rate: float = 1e-3
    """Adam learning rate at the start."""
    anneal_lr: bool = True
    """Decay the learning rate linearly to 0 over total_steps."""
    clip_eps: float = 0.2
    """Clip range of the probability ratio, at the start."""
    anneal_clip: bool = True
    """Decay clip_eps linearly to 0 over total_steps (as rl-baselines3-zoo does for CartPole)."""
    clip_value: bool = False
    """Also clip the value function's change around the old values (PPO2 style)."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    max_grad_norm: float = 0.5
    """Clip the global gradient norm to this."""
    normalize_advantages: bool = True
    """Standardise advantages within each minibatch."""
    target_kl: float | None = None
    """Stop the epochs of an update early once the k3 approx-KL exceeds this (None: never)."""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """Hidden layer widths of the policy and value MLPs."""
    total_steps: int = 200_000
    """Env-step budget (also the horizon of the learning-rate and clip schedules)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            positive_int=("num_envs", "num_steps", "num_minibatches", "update_epochs", "total_steps"),
            unit=("gamma", "lam"),
            nonneg=("learning_rate", "vf_coef", "ent_coef", "target_kl"),
            positive=("clip_eps", "max_grad_norm"),
            optional=("target_kl",),
            sizes=("hidden_sizes",),
            choices={"env_backend": ("gymnasium", "torch")},
        )
        if (self.num_envs * self.num_steps) % self.num_minibatches:
            raise ValueError(
                f"PPOConfig.num_minibatches ({self.num_minibatches}) must divide num_envs * num_steps "
                f"({self.num_envs * self.num_steps}), the batch of one update."
            )


@torch.no_grad()
def ppo_diagnostics(
    train_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, clip_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How far the policy has moved from the one that sampled the batch.

    approx_kl_k1 = mean(q - lp) and approx_kl_k3 = mean((r - 1) - log r), both estimating KL(pi_old || pi)
    from samples of pi_old (Schulman, 2020, "Approximating KL divergence"); k3 is never negative and has
    lower variance. clip_fraction = share of samples with r outside [1 - eps, 1 + eps], where the clip cut
    the gradient (for samples whose advantage sign makes it bind): :func:`edurl.objectives.clip_fraction`,
    the one Chapter 7 logs too. Returns (approx_kl_k1, approx_kl_k3, clip_fraction) as
    0-d tensors, so the training loop never waits on a device sync.
    """
    log_ratio = train_logprobs - sampling_logprobs
    ratio = log_ratio.exp()
    return (
        (-log_ratio).mean(),
        ((ratio - 1) - log_ratio).mean(),
        clip_fraction(train_logprobs, sampling_logprobs, None, 1 - clip_eps, 1 + clip_eps),
    )


@dataclass
class PPOBatch:
    """One update's batch, flattened over (T, N) into B = T * N samples; every field is a tensor with B rows.

    ``sampling_logprobs`` are log pi_old(a|s) of the policy that collected the batch; ``values`` its critic's
    V(s) at collection time; ``advantages`` and ``returns`` the GAE advantages and targets (Chapter 4).
    """

    obs: torch.Tensor  # (B, obs_dim)
    actions: torch.Tensor  # (B,)
    sampling_logprobs: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B,)
    returns: torch.Tensor  # (B,)
    values: torch.Tensor  # (B,)

    def __len__(self) -> int:
        return self.actions.shape[0]

    def minibatches(self, num_minibatches: int) -> Iterator[torch.Tensor | slice]:
        """The minibatches of one epoch, as indices into the batch: ``slice(None)`` (the whole batch) when
        ``num_minibatches`` is 1, else a fresh ``torch.randperm`` (the global generator) cut into equal parts."""
        size = len(self)
        if num_minibatches == 1:
            yield slice(None)
            return
        if size % num_minibatches:
            raise ValueError(f"num_minibatches ({num_minibatches}) must divide the batch size ({size}).")
        perm = torch.randperm(size, device=self.actions.device)
        step = size // num_minibatches
        for start in range(0, size, step):
            yield perm[start : start + step]


def _standardised(adv: torch.Tensor, config: PPOConfig) -> torch.Tensor:
    """Advantages to mean 0 and std 1 when ``config.normalize_advantages`` (and there are at least two)."""
    if config.normalize_advantages and adv.numel() > 1:
        return (adv - adv.mean()) / (adv.std() + 1e-8)
    return adv


def ppo_update(
    policy: CategoricalPolicy,
    value: ValueNet,
    optimizer: torch.optim.Optimizer,
    batch: PPOBatch,
    config: PPOConfig,
    clip_eps: float,
) -> int:
    """PPO's update: ``config.update_epochs`` passes over ``batch``, one optimizer step per minibatch, on

        L = clipped_surrogate(lp, q, A_norm, 1 - clip_eps, 1 + clip_eps).mean() + vf_coef * L_V - ent_coef * H

    with the advantages standardised within each minibatch, ``L_V = 0.5 * mean((V(s) - returns)^2)`` (clipped
    around ``batch.values`` if ``config.clip_value``) and the global gradient norm clipped at
    ``config.max_grad_norm``. This is Chapter 5's exercise 5.3, and ``train_ppo(config, update_fn=...)`` takes
    a learner's version of it. Returns the number of epochs run (fewer than ``update_epochs`` when the k3
    approx-KL of an epoch's last minibatch passes ``config.target_kl``).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for epoch in range(config.update_epochs):
        for idx in batch.minibatches(config.num_minibatches):
            train_logprobs, entropy = policy.logprob_and_entropy(batch.obs[idx], batch.actions[idx])
            adv = _standardised(batch.advantages[idx], config)  # detail: per-minibatch normalisation
            policy_loss = clipped_surrogate(
                train_logprobs, batch.sampling_logprobs[idx], adv, 1 - clip_eps, 1 + clip_eps
            ).mean()
            new_values, returns = value(batch.obs[idx]), batch.returns[idx]
            if config.clip_value:  # detail: optional value clipping around the old predictions
                old = batch.values[idx]
                clipped = old + (new_values - old).clamp(-clip_eps, clip_eps)
                value_loss = 0.5 * torch.max((new_values - returns) ** 2, (clipped - returns) ** 2).mean()
            else:
                value_loss = 0.5 * ((new_values - returns) ** 2).mean()
            loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy.mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)  # detail: global grad-norm clip
            optimizer.step()
        if config.target_kl is not None:
            _, kl, _ = ppo_diagnostics(train_logprobs.detach(), batch.sampling_logprobs[idx], clip_eps)
            if kl > config.target_kl:
                return epoch + 1  # detail: early stop once the k3 approx-KL passes target_kl
    return config.update_epochs


def collect_batch(env, policy, value, obs, config: PPOConfig, device: torch.device, counter=None):
    """One update's experience: ``config.num_steps`` steps of ``env`` with ``policy`` (pi_old), the critic's
    values, and GAE(``config.lam``) advantages and targets, flattened into a :class:`PPOBatch`.
    Returns ``(batch, rollout, obs to continue from, episode counter)``."""
    ro, obs, counter = collect_rollout(env, policy, obs, config.num_steps, device, counter)
    with torch.no_grad():
        values = value(ro.obs)  # (T, N)
        next_values = value(ro.next_obs)  # detail: V(final obs) bootstraps truncations; gae() zeroes terminals
    advantages, returns = gae(ro.rewards, values, next_values, ro.terminated, ro.truncated, config.gamma, config.lam)
    batch = PPOBatch(
        obs=ro.obs.flatten(0, 1),
        actions=ro.actions.flatten(),
        sampling_logprobs=ro.logprobs.flatten(),
        advantages=advantages.flatten(),
        returns=returns.flatten(),
        values=values.flatten(),
    )
    return batch, ro, obs, counter


@torch.no_grad()
def _after_update(
    policy: CategoricalPolicy, value: ValueNet, batch: PPOBatch, config: PPOConfig, clip_eps: float
) -> dict[str, torch.Tensor]:
    """Diagnostics of the policy and critic the update produced, on the whole batch: how far it moved pi from
    pi_old (approx KL, clip fraction), and its losses and entropy there. 0-d tensors: no device sync."""
    train_logprobs, entropy = policy.logprob_and_entropy(batch.obs, batch.actions)
    adv = _standardised(batch.advantages, config)
    k1, k3, clipped = ppo_diagnostics(train_logprobs, batch.sampling_logprobs, clip_eps)
    return {
        "policy_loss": clipped_surrogate(
            train_logprobs, batch.sampling_logprobs, adv, 1 - clip_eps, 1 + clip_eps
        ).mean(),
        "value_loss": 0.5 * ((value(batch.obs) - batch.returns) ** 2).mean(),
        "entropy": entropy.mean(),
        "approx_kl_k1": k1,
        "approx_kl_k3": k3,
        "clip_fraction": clipped,
    }


def make_env(config: PPOConfig, device: torch.device):
    """The vector env ``config.env_backend`` names, reset with ``config.seed``: ``(env, obs, obs_dim, num_actions)``."""
    if config.env_backend == "torch":
        if config.env_id != "CartPole-v1":
            raise ValueError(f"env_backend='torch' has only CartPole-v1, got env_id={config.env_id!r}.")
        from edurl.envs import TorchCartPole

        env = TorchCartPole(config.num_envs, device=device)
        obs, _ = env.reset(seed=config.seed)
        return env, obs, env.obs_dim, env.num_actions
    if config.env_backend == "gymnasium":
        env = make_vector_env(config.env_id, config.num_envs)
        obs, _ = env.reset(seed=config.seed)
        return env, obs, env.single_observation_space.shape[0], env.single_action_space.n
    raise ValueError(f"env_backend must be 'gymnasium' or 'torch', got {config.env_backend!r}.")


def train_ppo(config: PPOConfig, update_fn=None) -> TrainResult:
    """Train with PPO until solved (or ``total_steps``). ``result.updates`` holds the diagnostics per update,
    measured after each update on its whole batch.

    ``update_fn(policy, value, optimizer, batch, config, clip_eps)`` replaces :func:`ppo_update` (Chapter 5's
    exercise 5.3 passes the learner's); it may return the number of epochs it ran (None counts as all).
    """
    with torch_threads(config.num_threads, config.device):
        return _train(config, update_fn or ppo_update)


def _train(config: PPOConfig, update_fn) -> TrainResult:
    log = EpisodeLog(config)  # its clock starts here: setup counts toward time-to-solve
    edurl.seed_everything(config.seed)
    device = edurl.device(config.device)
    env, obs, obs_dim, num_actions = make_env(config, device)
    policy = CategoricalPolicy(obs_dim, num_actions, config.hidden_sizes).to(device)
    value = ValueNet(obs_dim, config.hidden_sizes).to(device)
    params = list(policy.parameters()) + list(value.parameters())
    # detail: Adam eps 1e-5; the fused kernel cuts per-step overhead, which dominates for nets this small
    optimizer = torch.optim.Adam(params, lr=config.learning_rate, eps=1e-5, fused=device.type in ("cpu", "cuda"))
    logger = MetricsLogger(config.log_dir, if_exists="overwrite") if config.log_dir else None

    batch_size = config.num_envs * config.num_steps
    num_updates = max(1, config.total_steps // batch_size)
    counter, updates = None, []
    bar = progress(total=num_updates * batch_size, desc="PPO env steps", disable=not config.progress)
    for update in range(num_updates):
        # detail: learning_rate and clip_eps decay linearly to 0 over the budget
        frac = 1.0 - update / num_updates
        learning_rate = config.learning_rate * frac if config.anneal_lr else config.learning_rate
        clip_eps = config.clip_eps * frac if config.anneal_clip else config.clip_eps
        for group in optimizer.param_groups:
            group["lr"] = learning_rate

        # ---- rollout and advantages (no grad): pi_old is the policy right now
        batch, ro, obs, counter = collect_batch(env, policy, value, obs, config, device, counter)

        # ---- several epochs of minibatch steps on the same batch, then how far they moved the policy
        epochs = update_fn(policy, value, optimizer, batch, config, clip_eps)
        stats = _after_update(policy, value, batch, config, clip_eps)

        # ---- bookkeeping (one host transfer per update)
        env_steps = (update + 1) * batch_size
        log.add(ro.episode_returns, ro.episode_lengths, env_steps)
        var_returns = batch.returns.var()
        row = dict(zip(stats, torch.stack(list(stats.values())).tolist()))
        row.update(
            step=env_steps,
            epochs=config.update_epochs if epochs is None else int(epochs),
            learning_rate=learning_rate,
            clip_eps=clip_eps,
            explained_variance=float(1 - (batch.returns - batch.values).var() / var_returns)
            if var_returns > 0
            else float("nan"),
        )
        updates.append(row)
        if logger:
            logger.log(
                env_steps,
                **{f"optim/{k}": v for k, v in row.items() if k != "step"},
                **{"episodes": len(log), "time/total": log.elapsed()},
            )
        bar.update(batch_size)
        bar.set_postfix(mean_return=f"{log.recent_mean():.0f}", kl=f"{row['approx_kl_k3']:.4f}", refresh=False)
        if ro.episode_returns and log.should_stop():
            break
    bar.close()
    if logger:
        logger.close()
    result = log.result(policy, value)
    result.updates = pd.DataFrame(updates)
    return result
