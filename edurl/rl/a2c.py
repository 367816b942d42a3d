"""Advantage actor-critic (A2C; Mnih et al., 2016, synchronous variant) with GAE advantages. Chapter 3.

Each update: collect T steps from N envs (same-step autoreset, true final observations kept),
compute GAE(lambda) advantages with termination and truncation kept apart (Chapter 4), then take
one gradient step on

    loss = -mean(log pi(a_t|s_t) * A_t)  +  vf_coef * 0.5 * mean((V(s_t) - R_t)^2)  -  ent_coef * mean(entropy)

where R_t = A_t + V(s_t) are the GAE value targets. Like PPO (Chapter 5), it trains ``num_seeds`` seeds side by
side in one process as a batch dimension (:mod:`edurl.rl.seed_stack`), and a single seed is a stack of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import edurl
from edurl._checks import check_fields, one_number
from edurl.rl.episodes import TrainerConfig, TrainResult
from edurl.rl.ppo import _standardised, collect_batch, make_env
from edurl.rl.seed_stack import ActorCriticStack, RowAdam, SeedRuns, clip_grad_norm_per_seed_, drop_seeds
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
    """Env-step budget per seed: batches are collected until it is spent, so a budget that is not a multiple of
    num_envs * num_steps is rounded up (train_ppo rounds down, to whole updates of its annealing schedule)."""
    env_backend: str = "gymnasium"
    """"gymnasium": a Gymnasium vector env of ``num_envs`` (any ``env_id``); "torch": ``TorchCartPole``, batched
    in torch (CartPole-v1 only, much faster for many seeds)."""
    num_seeds: int = 1
    """Seeds trained side by side in one process: seed, seed + 1, ..., as a batch dimension
    (edurl.rl.seed_stack). Seed i's run is the run num_seeds=1 makes with seed + i; train_a2c then
    returns one TrainResult per seed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            positive_int=("num_envs", "num_steps", "total_steps", "num_seeds"),
            unit=("gamma", "lam"),
            nonneg=("learning_rate", "vf_coef", "ent_coef"),
            positive=("max_grad_norm",),
            sizes=("hidden_sizes",),
            choices={"env_backend": ("gymnasium", "torch")},
        )


def train_a2c(config: A2CConfig, losses_fn=None) -> TrainResult | list[TrainResult]:
    """Train with A2C + GAE until solved (or ``total_steps``). See ``A2CConfig``.

    The seeds ``config.seed`` ... ``config.seed + num_seeds - 1`` train side by side in one process, each until
    it solves; with ``num_seeds`` > 1 the result is a list, one :class:`TrainResult` per seed, and seed i's equals
    that of ``num_seeds=1, seed=config.seed + i``.

    ``losses_fn(logprobs, returns, values) -> (policy_loss, value_loss)`` is Chapter 3's exercise 3.1
    (REINFORCE with a learned baseline) driving A2C, called once per seed on that seed's tensors: the policy loss
    comes from it with the GAE advantages (standardised when ``config.normalize_advantages``) as
    ``returns - values``, and the value loss with the GAE targets as ``returns``. Its results equal the built-in
    losses' up to float rounding (``returns - values`` is formed from a sum), so a seed's run follows another
    trajectory than without it.
    """
    if config.seed + config.num_seeds > 2**32:
        raise ValueError(f"seeds {config.seed}..{config.seed + config.num_seeds - 1} pass 2**32; lower A2CConfig.seed.")
    with torch_threads(config.num_threads, config.device):
        results = _train(config, losses_fn)
    return results[0] if config.num_seeds == 1 else results


def _losses(config: A2CConfig, logprobs, values, advantages, returns, losses_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Each seed's policy and value loss, (S,) each, from (S, B) tensors; with ``losses_fn``, one call per seed."""
    adv = _standardised(advantages, config)
    if losses_fn is None:
        return -(logprobs * adv).mean(-1), 0.5 * ((values - returns) ** 2).mean(-1)
    policy_losses, value_losses = [], []
    for lp, v, a, ret in zip(logprobs, values, adv, returns):  # the learner's exercise 3.1, seed by seed
        fixed = v.detach()
        policy_losses.append(
            one_number(losses_fn(lp, fixed + a, fixed)[0], "losses_fn", "check_baseline_losses", "policy loss")
        )
        value_losses.append(
            one_number(losses_fn(lp.detach(), ret, v)[1], "losses_fn", "check_baseline_losses", "value loss")
        )
    return torch.stack(policy_losses), torch.stack(value_losses)


def _train(config: A2CConfig, losses_fn=None) -> list[TrainResult]:
    seeds = [config.seed + s for s in range(config.num_seeds)]
    runs = SeedRuns(config, seeds)  # the seeds' logs: their clocks start here (setup counts)
    edurl.seed_everything(config.seed)
    device = edurl.device(config.device)
    env, obs, obs_dim, num_actions = make_env(config, device)
    try:
        runs.open_logs()  # only now: a run that fails to start leaves the last run's metrics
        stack = ActorCriticStack(seeds, obs_dim, num_actions, config.hidden_sizes, device)
        optimizer = RowAdam(stack.rows, lr=config.learning_rate)

        batch_size = config.num_steps * config.num_envs
        counter, env_steps = None, 0
        unit = "A2C env steps" + (f" (per seed, {len(seeds)} seeds)" if len(seeds) > 1 else "")
        bar = progress(total=config.total_steps, desc=unit, disable=not config.progress)
        while env_steps < config.total_steps:
            # ---- T steps of N envs per seed, and GAE (no grad; the value loss's forward is below)
            batch, ro, obs, counter = collect_batch(env, stack, stack.values, obs, config, device, counter)
            # ---- one gradient step per seed: the sum of the seeds' losses, each seed's gradient clipped on its own
            logprobs, entropy, values = stack.evaluate(batch.obs, batch.actions)
            policy_loss, value_loss = _losses(config, logprobs, values, batch.advantages, batch.returns, losses_fn)
            entropy = entropy.mean(-1)
            loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy
            optimizer.zero_grad()
            loss.sum().backward()  # d(sum)/d(row s) = d(loss_s)/d(row s): seeds never mix
            clip_grad_norm_per_seed_(stack.rows, config.max_grad_norm)
            optimizer.step()

            # ---- bookkeeping (one host transfer per update)
            env_steps += batch_size
            table = torch.stack([policy_loss, value_loss, entropy]).detach().T.tolist()
            rows = [{"optim/policy_loss": p, "optim/value_loss": v, "optim/entropy": e} for p, v, e in table]
            done = runs.record(ro, config.num_envs, env_steps, rows)
            runs.show(bar, batch_size, done)
            if len(done) == len(runs.live):
                break
            if done:
                optimizer, obs = drop_seeds(
                    stack, optimizer, env, obs, counter, runs.leave(done, stack.networks(done)), config.num_envs
                )
        bar.close()
        return runs.results(stack.networks())
    finally:
        env.close()  # Gymnasium's envs, and what they hold, go even if training stops with an error
