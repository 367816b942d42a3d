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
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

import edurl
from edurl._checks import check_fields
from edurl.objectives import clip_fraction, clipped_surrogate, clipped_surrogate_grad
from edurl.objectives import entropy as entropy_of  # "entropy" is a local name in the updates below
from edurl.rl.advantages import gae
from edurl.rl.episodes import TrainerConfig, TrainResult
from edurl.rl.networks import CategoricalPolicy, ValueNet
from edurl.rl.rollout import collect_rollout, make_vector_env, space_sizes
from edurl.rl.seed_stack import (
    ActorCriticStack,
    RowAdam,
    SeedRuns,
    clip_grad_norm_per_seed_,
    drop_seeds,
    fused_adam,
    inverse_cdf_sample,
)
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
    """Env-step budget per seed (also the horizon of the learning-rate and clip schedules): total_steps //
    (num_envs * num_steps) updates, at least 1, so a budget that is not a multiple of the batch is rounded down
    (train_a2c rounds up: it collects until the budget is spent)."""
    num_seeds: int = 1
    """Seeds trained side by side in one process: seed, seed + 1, ..., as a batch dimension
    (edurl.rl.seed_stack). Seed i's run is the run num_seeds=1 makes with seed + i; train_ppo then
    returns one TrainResult per seed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            positive_int=("num_envs", "num_steps", "num_minibatches", "update_epochs", "total_steps", "num_seeds"),
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
    the one Chapter 7 logs too. Returns (approx_kl_k1, approx_kl_k3, clip_fraction) as tensors, averaged over
    the last axis: 0-d for a batch (B,), one per seed for a seed stack's (S, B). No device sync.
    """
    log_ratio = train_logprobs - sampling_logprobs
    ratio = log_ratio.exp()
    return (
        (-log_ratio).mean(-1),
        ((ratio - 1) - log_ratio).mean(-1),
        clip_fraction(train_logprobs, sampling_logprobs, None, 1 - clip_eps, 1 + clip_eps, dim=-1),
    )


@dataclass
class PPOBatch:
    """One update's batch, flattened over (T, N) into B = T * N samples; every field is a tensor with B rows
    (with a leading seed axis, (S, B, ...), when a seed stack collected it: ``PPOConfig.num_seeds``).

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


def _var(x: torch.Tensor) -> torch.Tensor:
    """Sample variance along the last axis, keepdim. Written out because ``Tensor.var``'s float64 rounding on
    CPU depends on how many rows there are, and a seed's numbers must not depend on how many seeds train
    beside it (tests/rl/test_seed_stack.py)."""
    centred = x - x.mean(-1, keepdim=True)
    return centred.square().sum(-1, keepdim=True) / (x.shape[-1] - 1)


def _standardised(adv: torch.Tensor, config: PPOConfig) -> torch.Tensor:
    """Advantages to mean 0 and std 1 along the last axis (per seed, for a stack) when
    ``config.normalize_advantages`` (and there are at least two)."""
    if config.normalize_advantages and adv.shape[-1] > 1:
        return (adv - adv.mean(-1, keepdim=True)) / (_var(adv).sqrt() + 1e-8)
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
    Returns ``(batch, rollout, obs to continue from, episode counter)``.

    With an :class:`~edurl.rl.seed_stack.ActorCriticStack` as ``policy`` (and its ``values`` as ``value``)
    the env holds S blocks of N envs, and the batch comes out seed-major: (S, T * N, ...).
    """
    with policy.acting() if hasattr(policy, "acting") else nullcontext():  # a stack's weights, built once
        ro, obs, counter = collect_rollout(env, policy, obs, config.num_steps, device, counter)
    S = getattr(policy, "num_seeds", 1)
    T = config.num_steps

    def seed_major(x: torch.Tensor) -> torch.Tensor:  # (T, S * N, ...) -> (S, T * N, ...), t-major within a seed
        # contiguous: with N = 1 the flatten is a strided view, whose sums run in another order than a lone seed's
        return x.unflatten(1, (S, -1)).transpose(0, 1).flatten(1, 2).contiguous()

    def time_major(x: torch.Tensor) -> torch.Tensor:  # (S, T * N) -> (T, S * N)
        return x.unflatten(1, (T, -1)).transpose(0, 1).flatten(1, 2)

    with torch.no_grad():
        values = value(seed_major(ro.obs))  # (S, T * N)
        next_values = value(
            seed_major(ro.next_obs)
        )  # detail: V(final obs) bootstraps truncations; gae() zeroes terminals
    advantages, returns = gae(
        ro.rewards, time_major(values), time_major(next_values), ro.terminated, ro.truncated, config.gamma, config.lam
    )
    batch = PPOBatch(
        obs=seed_major(ro.obs),
        actions=seed_major(ro.actions),
        sampling_logprobs=seed_major(ro.logprobs),
        advantages=seed_major(advantages),
        returns=seed_major(returns),
        values=values,
    )
    if not hasattr(policy, "num_seeds"):  # one module policy: a plain (B, ...) batch
        batch = PPOBatch(*(getattr(batch, f).squeeze(0) for f in PPOBatch.__dataclass_fields__))
    return batch, ro, obs, counter


@torch.no_grad()
def _loss_grads(
    logits: torch.Tensor, values: torch.Tensor, mb: PPOBatch, adv: torch.Tensor, config: PPOConfig, clip_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a seed stack's minibatch, logits (S, M, A) and values (S, M): the log-probs of the actions taken, and
    the gradients of the seeds' summed losses with respect to the logits and the values. Seed s's loss is
    ``ppo_update``'s, ``mean(clipped_surrogate) + vf_coef * L_V - ent_coef * mean(H)``, and these are the
    gradients autograd takes through it (``tests/rl/test_seed_stack.py`` compares them), in closed form:

    - through log_softmax, d lp / d logits = onehot(a) - p;
    - the entropy's, dH / d logits = -p (log p + H);
    - the value loss's, (V - R) / M, or where ``clip_value`` picks the clipped prediction c, (c - R) / M where
      the clamp lets V through and 0 where it does not (half of each on a tie, as torch.max splits it).
    """
    M = logits.shape[1]
    logp = torch.log_softmax(logits, -1)
    actions = mb.actions.unsqueeze(-1)
    train_logprobs = logp.gather(-1, actions).squeeze(-1)
    grad_lp = clipped_surrogate_grad(train_logprobs, mb.sampling_logprobs, adv, 1 - clip_eps, 1 + clip_eps) / M
    p = logp.exp()
    grad_logits = (p * grad_lp.unsqueeze(-1)).neg_().scatter_add_(-1, actions, grad_lp.unsqueeze(-1))
    if config.ent_coef != 0:
        logp_or_0 = torch.where(p > 0, logp, 0.0)  # 0 log 0 = 0, as edurl.objectives.entropy has it
        grad_logits += (config.ent_coef / M) * p * (logp_or_0 + entropy_of(logp).unsqueeze(-1))
    error = values - mb.returns
    if config.clip_value:
        moved = values - mb.values
        clipped_error = mb.values + moved.clamp(-clip_eps, clip_eps) - mb.returns
        through = (moved >= -clip_eps) & (moved <= clip_eps)  # where the clamp passes a gradient
        square, clipped_square = error.square(), clipped_error.square()
        grad_values = torch.where(
            square > clipped_square,
            error,
            torch.where(
                square < clipped_square,
                clipped_error * through,
                0.5 * error + 0.5 * clipped_error * through,
            ),
        )
    else:
        grad_values = error
    return train_logprobs, grad_logits, grad_values * (config.vf_coef / M)


def _stack_update(
    stack: ActorCriticStack,
    optimizer: RowAdam,
    batch: PPOBatch,
    config: PPOConfig,
    clip_eps: float,
) -> list[int]:
    """:func:`ppo_update` for a seed stack: the same loss per seed, summed over seeds (so each seed's row
    gets its own gradient), each seed's gradient norm clipped on its own, each seed's epochs stopped by its
    own ``target_kl``. ``optimizer`` (a :class:`RowAdam`) holds ``stack.rows``; a seed whose epochs have stopped
    has its gradient set to None, which Adam skips: its parameters, moments and step count stay as they are.
    Returns the epochs each seed ran."""
    S, B = batch.actions.shape
    active = [True] * S
    epochs = [config.update_epochs] * S
    rows = torch.arange(S, device=stack.device)[:, None]
    whole = _standardised(batch.advantages, config) if config.num_minibatches == 1 else None  # same every epoch
    for epoch in range(config.update_epochs):
        if config.num_minibatches == 1:
            parts = [None]
        else:
            perm = stack.randperms(B, active)  # (S, B), one order per seed
            parts = perm.chunk(config.num_minibatches, dim=1)
        for idx in parts:
            mb = (
                batch
                if idx is None
                else PPOBatch(*(getattr(batch, f)[rows, idx] for f in PPOBatch.__dataclass_fields__))
            )
            logits, new_values, saved = stack.forward_saved(mb.obs)
            adv = whole if idx is None else _standardised(mb.advantages, config)  # detail: per-minibatch, per seed
            train_logprobs, grad_logits, grad_values = _loss_grads(logits, new_values, mb, adv, config, clip_eps)
            stack.backward_rows(saved, grad_logits, grad_values)  # loss.backward(), written out: seeds never mix
            for row, on in zip(stack.rows, active):
                if not on:
                    row.grad = None  # Adam skips it
            clip_grad_norm_per_seed_(stack.rows, config.max_grad_norm)  # detail: global grad-norm clip, per seed
            optimizer.step()
        if config.target_kl is not None:
            _, kl, _ = ppo_diagnostics(train_logprobs.detach(), mb.sampling_logprobs, clip_eps)
            for s, value in enumerate(kl.tolist()):
                if active[s] and value > config.target_kl:
                    active[s], epochs[s] = False, epoch + 1  # detail: early stop once the k3 approx-KL passes
            if not any(active):
                break
    return epochs


@torch.no_grad()
def _after_update(policy, value, batch: PPOBatch, config: PPOConfig, clip_eps: float) -> dict[str, torch.Tensor]:
    """Diagnostics of the policy and critic the update produced, on the whole batch: how far it moved pi from
    pi_old (approx KL, clip fraction), and its losses and entropy there. Tensors averaged over the last axis
    (0-d for one policy, (S,) for a seed stack): no device sync."""
    train_logprobs, entropy = policy.logprob_and_entropy(batch.obs, batch.actions)
    adv = _standardised(batch.advantages, config)
    k1, k3, clipped = ppo_diagnostics(train_logprobs, batch.sampling_logprobs, clip_eps)
    return {
        "policy_loss": clipped_surrogate(train_logprobs, batch.sampling_logprobs, adv, 1 - clip_eps, 1 + clip_eps).mean(
            -1
        ),
        "value_loss": 0.5 * ((value(batch.obs) - batch.returns) ** 2).mean(-1),
        "entropy": entropy.mean(-1),
        "approx_kl_k1": k1,
        "approx_kl_k3": k3,
        "clip_fraction": clipped,
    }


class _ModuleSampler:
    """A module policy acting as a stack of one seed acts: uniforms from the seed's own generator, inverted
    through the CDF, so the library's update and a learner's ``update_fn`` see the same first rollouts."""

    def __init__(self, policy: CategoricalPolicy, generator: torch.Generator):
        self.policy, self.generator = policy, generator

    @torch.no_grad()
    def sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(self.policy.net(obs), -1)
        u = torch.rand(obs.shape[0], 1, generator=self.generator, device=obs.device, dtype=logp.dtype)
        return inverse_cdf_sample(logp, u)


class _SeedVectorEnvs:
    """S Gymnasium vector envs of N envs each, stepped as one of S * N (block s reset with seed s)."""

    def __init__(self, envs: list):
        self.envs, self.num_envs = envs, sum(e.num_envs for e in envs)
        self.metadata = envs[0].metadata
        self.single_observation_space, self.single_action_space = (
            envs[0].single_observation_space,
            envs[0].single_action_space,
        )

    def reset(self, seed: list[int]):
        obs = [env.reset(seed=s)[0] for env, s in zip(self.envs, seed)]
        return np.concatenate(obs), {}

    def keep_blocks(self, blocks: list[int]) -> None:
        for b, env in enumerate(self.envs):
            if b not in blocks:
                env.close()
        self.envs = [self.envs[b] for b in blocks]
        self.num_envs = sum(e.num_envs for e in self.envs)

    def close(self) -> None:
        for env in self.envs:
            env.close()

    def step(self, actions):
        outs = [env.step(a) for env, a in zip(self.envs, np.split(np.asarray(actions), len(self.envs)))]
        final = np.empty(self.num_envs, dtype=object)
        n = self.envs[0].num_envs
        for s, (*_, info) in enumerate(outs):
            if "final_obs" in info:
                final[s * n : (s + 1) * n] = info["final_obs"]
        arrays = [np.concatenate([o[k] for o in outs]) for k in range(4)]
        return *arrays, {"final_obs": final}


def make_env(config: PPOConfig, device: torch.device):
    """The vector env ``config.env_backend`` names, reset with ``config.seed``: ``(env, obs, obs_dim, num_actions)``.

    With ``config.num_seeds`` = S > 1 it holds S blocks of ``num_envs`` envs, block s reset with
    ``config.seed + s`` exactly as a one-seed env would be."""
    seeds = [config.seed + s for s in range(config.num_seeds)]
    if config.env_backend == "torch":
        if config.env_id != "CartPole-v1":
            raise ValueError(f"env_backend='torch' has only CartPole-v1, got env_id={config.env_id!r}.")
        from edurl.envs import TorchCartPole

        env = TorchCartPole(
            config.num_envs * len(seeds), device=device, dtype=torch.get_default_dtype(), check_actions=False
        )
        obs, _ = env.reset(seed=seeds if len(seeds) > 1 else config.seed)
        return env, obs, env.obs_dim, env.num_actions
    if config.env_backend == "gymnasium":
        if len(seeds) == 1:
            env = make_vector_env(config.env_id, config.num_envs)
            obs, _ = env.reset(seed=config.seed)
        else:
            env = _SeedVectorEnvs([make_vector_env(config.env_id, config.num_envs) for _ in seeds])
            obs, _ = env.reset(seed=seeds)
        try:
            sizes = space_sizes(env.single_observation_space, env.single_action_space, config.env_id)
        except ValueError:  # a space the course's networks cannot take: say so, and leave nothing open
            env.close()
            raise
        return env, obs, *sizes
    raise ValueError(f"env_backend must be 'gymnasium' or 'torch', got {config.env_backend!r}.")


def train_ppo(config: PPOConfig, update_fn=None) -> TrainResult | list[TrainResult]:
    """Train with PPO until solved (or ``total_steps``). ``result.updates`` holds the diagnostics per update,
    measured after each update on its whole batch.

    The seeds ``config.seed`` ... ``config.seed + num_seeds - 1`` train side by side in one process
    (:mod:`edurl.rl.seed_stack`), each until it solves; with ``num_seeds`` > 1 the result is a list, one
    :class:`TrainResult` per seed, and seed i's equals that of ``num_seeds=1, seed=config.seed + i``.

    ``update_fn(policy, value, optimizer, batch, config, clip_eps)`` replaces :func:`ppo_update` (Chapter 5's
    exercise 5.3 passes the learner's) on ordinary modules and ``torch.optim.Adam``, one seed at a time;
    it may return the number of epochs it ran (None counts as all).
    """
    if update_fn is not None and config.num_seeds != 1:
        raise ValueError(
            f"update_fn trains one seed at a time, got num_seeds={config.num_seeds}: call train_ppo once per seed "
            "(PPOConfig(seed=s)), or drop update_fn to train the seeds together with the library's update."
        )
    if config.seed + config.num_seeds > 2**32:
        raise ValueError(f"seeds {config.seed}..{config.seed + config.num_seeds - 1} pass 2**32; lower PPOConfig.seed.")
    with torch_threads(config.num_threads, config.device):
        results = _train(config, update_fn)
    return results[0] if config.num_seeds == 1 else results


def _train(config: PPOConfig, update_fn) -> list[TrainResult]:
    seeds = [config.seed + s for s in range(config.num_seeds)]
    runs = SeedRuns(config, seeds)  # the seeds' logs: their clocks start here (setup counts)
    edurl.seed_everything(config.seed)
    device = edurl.device(config.device)
    env, obs, obs_dim, num_actions = make_env(config, device)
    try:
        runs.open_logs()  # only now: a run that fails to start leaves the last run's metrics
        if update_fn is None:
            stack = ActorCriticStack(seeds, obs_dim, num_actions, config.hidden_sizes, device)
            # detail: Adam eps 1e-5; one fused kernel for every seed's step, which matters for nets this small
            optimizer = RowAdam(stack.rows, lr=config.learning_rate, eps=1e-5)
            policy = sampler = stack
            value = stack.values

            def run_update(batch: PPOBatch, clip_eps: float, lr: float) -> list[int]:
                optimizer.lr = lr
                return _stack_update(stack, optimizer, batch, config, clip_eps)

            def networks(positions: list[int] | None = None) -> list:
                return stack.networks(positions)

            def keep(positions: list[int]) -> None:
                nonlocal optimizer, obs
                optimizer, obs = drop_seeds(stack, optimizer, env, obs, counter, positions, config.num_envs)
        else:  # the learner's update on one seed's modules
            torch.manual_seed(config.seed)
            policy = CategoricalPolicy(obs_dim, num_actions, config.hidden_sizes).to(device)
            value = ValueNet(obs_dim, config.hidden_sizes).to(device)
            params = list(policy.parameters()) + list(value.parameters())
            optimizer = torch.optim.Adam(params, lr=config.learning_rate, eps=1e-5, fused=fused_adam(device))
            sampler = _ModuleSampler(policy, torch.Generator(device=device).manual_seed(config.seed))

            def run_update(batch: PPOBatch, clip_eps: float, lr: float) -> list[int]:
                for group in optimizer.param_groups:
                    group["lr"] = lr
                epochs = update_fn(policy, value, optimizer, batch, config, clip_eps)
                return [config.update_epochs if epochs is None else int(epochs)]

            def networks(positions: list[int] | None = None) -> list:
                return [(policy, value)]

            keep = None  # one seed: when it finishes, the run ends

        batch_size = config.num_envs * config.num_steps
        num_updates = max(1, config.total_steps // batch_size)
        counter, updates = None, [[] for _ in seeds]
        unit = "PPO env steps" + (f" (per seed, {len(seeds)} seeds)" if len(seeds) > 1 else "")
        bar = progress(total=num_updates * batch_size, desc=unit, disable=not config.progress)
        for update in range(num_updates):
            # detail: learning_rate and clip_eps decay linearly to 0 over the budget
            frac = 1.0 - update / num_updates
            learning_rate = config.learning_rate * frac if config.anneal_lr else config.learning_rate
            clip_eps = config.clip_eps * frac if config.anneal_clip else config.clip_eps

            # ---- rollout and advantages (no grad): pi_old is the policy right now
            batch, ro, obs, counter = collect_batch(env, sampler, value, obs, config, device, counter)

            # ---- several epochs of minibatch steps on the same batch, then how far they moved the policy
            epochs = run_update(batch, clip_eps, learning_rate)
            stats = _after_update(policy, value, batch, config, clip_eps)

            # ---- bookkeeping (one host transfer per update)
            env_steps = (update + 1) * batch_size
            resid = _var(batch.returns - batch.values).squeeze(-1)
            var_returns = _var(batch.returns).squeeze(-1)
            table = torch.stack([*stats.values(), resid, var_returns]).reshape(len(stats) + 2, -1).T.tolist()
            rows = []
            for pos, (s, seed_row) in enumerate(zip(runs.live, table)):
                *values, resid_s, var_s = seed_row
                row = dict(zip(stats, values))
                row.update(
                    step=env_steps,
                    epochs=epochs[pos],
                    learning_rate=learning_rate,
                    clip_eps=clip_eps,
                    explained_variance=1 - resid_s / var_s if var_s > 0 else float("nan"),
                )
                updates[s].append(row)
                rows.append({f"optim/{k}": v for k, v in row.items() if k != "step"})
            done = runs.record(ro, config.num_envs, env_steps, rows)
            runs.show(bar, batch_size, done, kl=f"{table[0][list(stats).index('approx_kl_k3')]:.4f}")
            if len(done) == len(runs.live):
                break
            if done:
                keep(runs.leave(done, networks(done)))
        bar.close()
        results = runs.results(networks())
        for result, rows in zip(results, updates):
            result.updates = pd.DataFrame(rows)
        return results
    finally:
        env.close()  # Gymnasium's envs, and what they hold, go even if training stops with an error
