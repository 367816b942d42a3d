"""REINFORCE (Williams, 1992) with reward-to-go and an optional learned baseline. Chapters 2 and 3.

The policy gradient theorem (Sutton et al., 2000) gives

    grad J(theta) = E[ sum_t grad log pi_theta(a_t | s_t) * G_t ],

so minimising  -mean_t( log pi(a_t | s_t) * A_t )  with A_t = G_t (or G_t - b(s_t)) climbs J.
Each update here uses ``episodes_per_update`` complete, fresh episodes: exact returns, strictly on-policy.
With ``env_backend="torch"`` the episodes run in a ``TorchCartPole``, and ``num_seeds`` seeds train side by side
in one process (:mod:`edurl.rl.seed_stack`; Chapter 2's section 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import gymnasium as gym
import torch

import edurl
from edurl._checks import check_fields, one_number
from edurl.metrics import MetricsLogger
from edurl.rl.episodes import EpisodeLog, TrainerConfig, TrainResult
from edurl.rl.networks import CategoricalPolicy, ValueNet
from edurl.rl.returns import discounted_returns
from edurl.rl.rollout import EpisodeBatch, collect_episodes, space_sizes
from edurl.rl.seed_stack import ActorCriticStack, RowAdam, SeedRuns, inverse_cdf_sample, keep_seeds
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
    """Stop after this many training episodes (per seed), rounded up to whole updates: with 8 episodes per update,
    ``max_episodes=10`` plays 16."""
    env_backend: str = "gymnasium"
    """"gymnasium": one Gymnasium env per episode (any ``env_id``). "torch": the episodes of every seed in one
    ``TorchCartPole`` (CartPole-v1 only), actions from a seed stack (edurl.rl.seed_stack); needed for
    ``num_seeds`` > 1. The two backends draw different start states and actions, so a seed's run differs."""
    num_seeds: int = 1
    """Seeds trained side by side in one process (``env_backend="torch"``): seed, seed + 1, ..., as a batch
    dimension. Seed i's run is the run num_seeds=1 makes with seed + i; train_reinforce then returns one
    TrainResult per seed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            positive_int=("episodes_per_update", "max_episodes", "num_seeds"),
            unit=("gamma",),
            nonneg=("learning_rate", "value_learning_rate"),
            sizes=("hidden_sizes",),
            choices={"baseline": ("none", "value"), "env_backend": ("gymnasium", "torch")},
        )
        if self.num_seeds > 1 and self.env_backend != "torch":
            raise ValueError(
                f"ReinforceConfig.num_seeds={self.num_seeds} trains the seeds side by side in one TorchCartPole: "
                "set env_backend='torch' (CartPole-v1), or train one seed at a time on Gymnasium."
            )
        if self.env_backend == "torch" and self.baseline == "value" and self.value_learning_rate != self.learning_rate:
            raise ValueError(
                "env_backend='torch' keeps each seed's policy and value in one tensor under one Adam, so it needs "
                f"value_learning_rate == learning_rate (got {self.value_learning_rate} and {self.learning_rate}); "
                "set them equal, or use env_backend='gymnasium'."
            )


def _scalar(loss) -> float:
    """A loss as a float for the log: a tensor's value (detached, so torch does not warn), or an update_fn's own
    float (the 2.2 checker accepts ``loss.item()``)."""
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)


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
    if (value is None) != (value_optimizer is None):  # before a whole batch is played, not after
        given, missing = ("value", "value_optimizer") if value_optimizer is None else ("value_optimizer", "value")
        raise ValueError(f"reinforce_update got {given} without {missing}: a learned baseline needs both, or neither")
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
    if loss_fn:
        loss = one_number(loss_fn(logprobs, weights), "loss_fn", "check_reinforce_loss")
    else:
        loss = reinforce_loss(logprobs, weights, normalize_advantages)
    optimizer.zero_grad()  # 4. (without it, gradients of earlier updates would add up)
    loss.backward()
    optimizer.step()
    return batch, loss


def train_reinforce(config: ReinforceConfig, loss_fn=None, update_fn=None) -> TrainResult | list[TrainResult]:
    """Train a policy with REINFORCE until solved (or ``max_episodes``). See ``ReinforceConfig``.

    ``loss_fn(logprobs, weights) -> scalar`` replaces the surrogate loss, e.g. with your own from
    exercise 2.1 (it should normalise the weights itself). By default it is ``reinforce_loss`` with
    ``config.normalize_advantages``.

    ``update_fn(policy, optimizer, envs, seeds, gamma, device) -> (batch, loss)`` replaces the whole
    update, e.g. with your own from exercise 2.2; it has no learned baseline, so it needs
    ``baseline="none"``, and it computes its own loss, so it cannot be given with ``loss_fn``.

    With ``env_backend="torch"``, the seeds ``config.seed`` ... ``config.seed + num_seeds - 1`` train side by side
    in one process, each until it solves; with ``num_seeds`` > 1 the result is a list, one :class:`TrainResult`
    per seed, and seed i's equals that of ``num_seeds=1, seed=config.seed + i``. ``loss_fn`` is then called once
    per seed; ``update_fn`` plays Gymnasium envs and is refused there.
    """
    if update_fn is not None and config.baseline != "none":
        raise ValueError(
            f"update_fn replaces the whole update, which has no learned baseline, but baseline={config.baseline!r}: "
            "use ReinforceConfig(baseline='none') with update_fn."
        )
    if update_fn is not None and loss_fn is not None:
        raise ValueError("update_fn computes its own loss: pass update_fn or loss_fn, not both.")
    if config.env_backend == "torch":
        if update_fn is not None:
            raise ValueError(
                "update_fn plays its own episodes on Gymnasium envs: use env_backend='gymnasium' with update_fn."
            )
        if config.env_id != "CartPole-v1":
            raise ValueError(f"env_backend='torch' has only CartPole-v1, got env_id={config.env_id!r}.")
        if config.seed + config.num_seeds > 2**32:
            raise ValueError(f"seeds {config.seed}..{config.seed + config.num_seeds - 1} pass 2**32; lower the seed.")
        with torch_threads(config.num_threads, config.device):
            results = _train_stacked(config, loss_fn)
        return results[0] if config.num_seeds == 1 else results
    with torch_threads(config.num_threads, config.device):
        return _train(config, loss_fn, update_fn)


def _train(config: ReinforceConfig, loss_fn, update_fn) -> TrainResult:
    log = EpisodeLog(config)  # its clock starts here: setup counts toward time-to-solve
    edurl.seed_everything(config.seed)
    device = edurl.device(config.device)
    envs = [gym.make(config.env_id) for _ in range(config.episodes_per_update)]
    try:
        obs_dim, num_actions = space_sizes(envs[0].observation_space, envs[0].action_space, config.env_id)
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
            seeds = _episode_seeds(config, config.seed, len(log))
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
                        "optim/policy_loss": _scalar(loss),
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
    finally:
        for env in envs:
            env.close()


def _episode_seeds(config: ReinforceConfig, seed: int, episodes_so_far: int) -> list[int]:
    """The reset seeds of a seed's next ``episodes_per_update`` episodes (both backends use this rule)."""
    first = seed * 1_000_003 + episodes_so_far
    return [first + i for i in range(config.episodes_per_update)]


@torch.no_grad()
def _play_stacked(env, stack: ActorCriticStack, episode_seeds: list[int]) -> EpisodeBatch:
    """One whole episode in each env of ``env`` (a ``TorchCartPole`` without autoreset, S blocks of E envs, block s
    being seed s's), env j started from ``episode_seeds[j]``. Seed s acts with its policy and uniforms from its
    own generator, drawn only while one of its episodes is still running, so its run does not depend on how long
    the other seeds' episodes last. Returns the (T, S * E) :class:`EpisodeBatch`."""
    obs, _ = env.reset(seed=episode_seeds)  # a generator per env: start states from the episode's own seed
    S = stack.num_seeds
    E = env.num_envs // S
    running = torch.ones(env.num_envs, dtype=torch.bool, device=env.device)
    steps, terminated_flags = [], torch.zeros_like(running)
    with stack.acting():
        while True:
            busy = running.view(S, E).any(1).tolist()  # one host sync per step
            if not any(busy):
                break
            logp = torch.log_softmax(stack.logits(obs.view(S, E, -1)), -1)  # (S, E, A)
            u = torch.stack(
                [
                    torch.rand(E, 1, generator=g, device=env.device, dtype=logp.dtype) if b else logp.new_zeros(E, 1)
                    for g, b in zip(stack.generators, busy)
                ]
            )
            actions = inverse_cdf_sample(logp, u)[0].flatten()  # (S * E,)
            next_obs, reward, terminated, truncated, _ = env.step(actions)
            steps.append((obs, actions, reward * running, running))
            terminated_flags |= terminated & running
            running = running & ~(terminated | truncated)
            obs = next_obs
    mask = torch.stack([s[3] for s in steps])  # (T, S * E)
    t = torch.arange(len(steps), device=env.device)[:, None]
    return EpisodeBatch(
        obs=torch.stack([s[0] for s in steps]),
        actions=torch.stack([s[1] for s in steps]),
        rewards=torch.stack([s[2] for s in steps]),
        dones=t == mask.sum(0, keepdim=True) - 1,
        mask=mask,
        terminated=terminated_flags,
    )


def _train_stacked(config: ReinforceConfig, loss_fn) -> list[TrainResult]:
    """REINFORCE for ``config.num_seeds`` seeds side by side: every seed's E episodes in one ``TorchCartPole``, one
    batched forward pass per step, then each seed's update on its own steps (their number differs from seed to
    seed, so each seed's loss is computed in a pass of its own shape), one Adam over the seeds' rows."""
    from edurl.envs import TorchCartPole  # noqa: PLC0415 (envs imports torch only; kept beside its one use)

    seeds = [config.seed + s for s in range(config.num_seeds)]
    runs = SeedRuns(config, seeds)  # the seeds' logs: their clocks start here (setup counts)
    edurl.seed_everything(config.seed)
    device = edurl.device(config.device)
    E = config.episodes_per_update
    stack = ActorCriticStack(seeds, TorchCartPole.obs_dim, TorchCartPole.num_actions, config.hidden_sizes, device)
    optimizer = RowAdam(stack.rows, lr=config.learning_rate)
    runs.open_logs()  # only now: a run that fails to start leaves the last run's metrics
    baseline = config.baseline == "value"
    env_steps = [0] * len(seeds)
    unit = "REINFORCE episodes" + (f" (per seed, {len(seeds)} seeds)" if len(seeds) > 1 else "")
    bar = progress(total=config.max_episodes, desc=unit, disable=not config.progress)
    while len(runs.logs[runs.live[0]]) < config.max_episodes:
        env = TorchCartPole(
            len(runs.live) * E, device=device, dtype=torch.get_default_dtype(), autoreset=False, check_actions=False
        )
        batch = _play_stacked(
            env, stack, [x for s in runs.live for x in _episode_seeds(config, seeds[s], len(runs.logs[s]))]
        )
        returns = discounted_returns(batch.rewards, batch.dones, config.gamma)
        total, rows, steps = 0.0, [], []
        for pos in range(len(runs.live)):
            cols = slice(pos * E, (pos + 1) * E)
            m = batch.mask[:, cols]
            obs, actions, G = batch.obs[:, cols][m], batch.actions[:, cols][m], returns[:, cols][m]
            steps.append((obs, actions))
            logprobs, _, values = stack.seed_outputs(pos, obs, actions)
            weights, value_loss = G, 0.0
            if baseline:  # G_t - V(s_t); V regresses on G_t in the same step (its own part of the row)
                value_loss = 0.5 * ((values - G) ** 2).mean()
                weights = G - values.detach()
            loss = (
                one_number(loss_fn(logprobs, weights), "loss_fn", "check_reinforce_loss")
                if loss_fn
                else reinforce_loss(logprobs, weights, config.normalize_advantages)
            )
            total = total + loss + value_loss
            rows.append({"optim/policy_loss": _scalar(loss)})
        optimizer.zero_grad()
        total.backward()  # d(sum)/d(row s) = d(loss_s)/d(row s): seeds never mix
        optimizer.step()
        if any(runs.loggers):  # as the Gymnasium path logs it: the updated policy's entropy on the batch's states
            with torch.no_grad():
                for pos, (row, (obs, actions)) in enumerate(zip(rows, steps)):
                    row["optim/entropy"] = float(stack.seed_outputs(pos, obs, actions)[1].mean())

        lengths = batch.lengths
        for pos, s in enumerate(runs.live):
            env_steps[s] += int(lengths[pos * E : (pos + 1) * E].sum())
        episodes = SimpleNamespace(
            episode_envs=list(range(len(runs.live) * E)),
            episode_returns=batch.episode_returns.tolist(),
            episode_lengths=lengths.tolist(),
        )
        for pos, row in enumerate(rows):
            row["env/episode_return_mean"] = sum(episodes.episode_returns[pos * E : (pos + 1) * E]) / E
        done = runs.record(episodes, E, [env_steps[s] for s in runs.live], rows)
        runs.show(bar, E, done)
        if len(done) == len(runs.live):
            break
        if done:
            optimizer = keep_seeds(stack, optimizer, runs.leave(done, _networks(stack, done, baseline)))
    bar.close()
    return runs.results(_networks(stack, None, baseline))


def _networks(stack: ActorCriticStack, positions, baseline: bool) -> list[tuple]:
    """(policy, value) of each seed at ``positions`` (all when None); value None without a learned baseline."""
    return [(p, v if baseline else None) for p, v in stack.networks(positions)]
