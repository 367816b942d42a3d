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

__all__ = ["PPOConfig", "ppo_diagnostics", "train_ppo"]


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


_STAT_NAMES = ("policy_loss", "value_loss", "entropy", "approx_kl_k1", "approx_kl_k3", "clip_fraction")


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


def _make_env(config: PPOConfig, device: torch.device):
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


def train_ppo(config: PPOConfig) -> TrainResult:
    """Train with PPO until solved (or ``total_steps``). ``result.updates`` holds the diagnostics per update."""
    with torch_threads(config.num_threads, config.device):
        return _train(config)


def _train(config: PPOConfig) -> TrainResult:
    log = EpisodeLog(config)  # its clock starts here: setup counts toward time-to-solve
    edurl.seed_everything(config.seed)
    device = edurl.device(config.device)
    env, obs, obs_dim, num_actions = _make_env(config, device)
    policy = CategoricalPolicy(obs_dim, num_actions, config.hidden_sizes).to(device)
    value = ValueNet(obs_dim, config.hidden_sizes).to(device)
    params = list(policy.parameters()) + list(value.parameters())
    # detail: Adam eps 1e-5; the fused kernel cuts per-step overhead, which dominates for nets this small
    optimizer = torch.optim.Adam(params, lr=config.learning_rate, eps=1e-5, fused=device.type in ("cpu", "cuda"))
    logger = MetricsLogger(config.log_dir, if_exists="overwrite") if config.log_dir else None

    batch_size = config.num_envs * config.num_steps
    minibatch_size = batch_size // config.num_minibatches
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
        ro, obs, counter = collect_rollout(env, policy, obs, config.num_steps, device, counter)
        with torch.no_grad():
            values = value(ro.obs)  # (T, N)
            next_values = value(ro.next_obs)  # detail: V(final obs) bootstraps truncations; gae() zeroes terminals
        advantages, returns = gae(
            ro.rewards, values, next_values, ro.terminated, ro.truncated, config.gamma, config.lam
        )
        b_obs, b_actions = ro.obs.reshape(batch_size, -1), ro.actions.reshape(-1)
        b_sampling_logprobs, b_adv = ro.logprobs.reshape(-1), advantages.reshape(-1)
        b_returns, b_values = returns.reshape(-1), values.reshape(-1)

        # ---- several epochs of minibatch updates on the same batch
        stats = []
        for epoch in range(config.update_epochs):
            # one minibatch = the whole batch, in any order; otherwise a fresh shuffle each epoch
            perm = torch.randperm(batch_size, device=device) if config.num_minibatches > 1 else slice(None)
            for start in range(0, batch_size, minibatch_size):
                idx = perm[start : start + minibatch_size] if config.num_minibatches > 1 else perm
                train_logprobs, entropy = policy.logprob_and_entropy(b_obs[idx], b_actions[idx])
                adv = b_adv[idx]
                if config.normalize_advantages and adv.numel() > 1:
                    adv = (adv - adv.mean()) / (adv.std() + 1e-8)  # detail: per-minibatch normalisation
                policy_loss = clipped_surrogate(
                    train_logprobs, b_sampling_logprobs[idx], adv, 1 - clip_eps, 1 + clip_eps
                ).mean()
                new_values = value(b_obs[idx])
                if config.clip_value:  # detail: optional value clipping around the old predictions
                    clipped = b_values[idx] + (new_values - b_values[idx]).clamp(-clip_eps, clip_eps)
                    value_loss = (
                        0.5 * torch.max((new_values - b_returns[idx]) ** 2, (clipped - b_returns[idx]) ** 2).mean()
                    )
                else:
                    value_loss = 0.5 * ((new_values - b_returns[idx]) ** 2).mean()
                entropy = entropy.mean()
                loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)  # detail: global grad-norm clip
                optimizer.step()
                if epoch == config.update_epochs - 1 or config.target_kl is not None:
                    # diagnostics of the last epoch: how far the policy ended up from pi_old
                    stats.append(
                        torch.stack(
                            [
                                policy_loss.detach(),
                                value_loss.detach(),
                                entropy.detach(),
                                *ppo_diagnostics(train_logprobs.detach(), b_sampling_logprobs[idx], clip_eps),
                            ]
                        )
                    )
            if config.target_kl is not None and stats[-1][4] > config.target_kl:
                break  # detail: early stop once the k3 approx-KL passes target_kl

        # ---- bookkeeping (one host transfer per update)
        env_steps = (update + 1) * batch_size
        log.add(ro.episode_returns, ro.episode_lengths, env_steps)
        var_returns = b_returns.var()
        row = dict(zip(_STAT_NAMES, torch.stack(stats[-config.num_minibatches :]).mean(0).tolist()))
        row.update(
            step=env_steps,
            epochs=epoch + 1,
            learning_rate=learning_rate,
            clip_eps=clip_eps,
            explained_variance=float(1 - (b_returns - b_values).var() / var_returns)
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
