"""Collecting experience from Gymnasium environments, correctly under Gymnasium 1.x autoreset. Chapters 2–5.

Two collectors:

- :func:`collect_episodes` (REINFORCE): one complete episode per environment, from fresh resets,
  so every step is on-policy and every return is exact. Finished environments are not stepped again.
- :func:`collect_rollout` (A2C, PPO): ``T`` steps from ``N`` environments that keep running across
  calls. It uses a vector env with **same-step** autoreset. When step t ends an episode, the env
  returns the *reset* observation of the next episode, and puts the true last observation in
  ``info["final_obs"]``. We store that final observation as s_{t+1}, so V(s_{t+1}) at a
  truncation is the value of the state the episode was cut at, never of a fresh start state.
  (With the default next-step mode, the step *after* a done is a reset step with no real
  transition in it. Training on it is a classic bug, and same-step mode has no such steps.)
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

from edurl._checks import check_count

__all__ = [
    "EpisodeBatch",
    "collect_episodes",
    "make_vector_env",
    "space_sizes",
    "Rollout",
    "collect_rollout",
    "evaluate_policy",
]


@dataclass
class EpisodeBatch:
    """N complete episodes, padded to the longest (T = its length). Time-major."""

    # fmt: off
    obs: torch.Tensor         # (T, N, obs_dim)
    actions: torch.Tensor     # (T, N) int64
    rewards: torch.Tensor     # (T, N) torch's default dtype, 0 after an episode's end
    dones: torch.Tensor       # (T, N) bool, True at each episode's last step
    mask: torch.Tensor        # (T, N) bool, True for real steps, False for padding
    terminated: torch.Tensor  # (N,) bool: did the episode end by termination (else truncation)?
    # fmt: on

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(0)

    @property
    def episode_returns(self) -> torch.Tensor:
        return self.rewards.sum(0)


def collect_episodes(envs: list[gym.Env], act, device: torch.device, seeds: list[int] | None = None) -> EpisodeBatch:
    """Run one episode in each env, choosing actions with ``act(obs (B, obs_dim)) -> (B,)``.

    Only the envs still running are stepped, so no step is simulated and thrown away.
    """
    n, dtype = len(envs), torch.get_default_dtype()  # Gymnasium's float32 observations, as the networks' dtype
    check_count(n, "collect_episodes' number of envs (len(envs))", "envs")
    if seeds is not None and len(seeds) != n:
        raise ValueError(f"collect_episodes needs one seed per env: got {len(seeds)} seeds for {n} envs.")
    space = envs[0].action_space if n else None  # a Discrete space's actions: start .. start + n - 1
    actions_range = (int(space.start), int(space.start + space.n)) if isinstance(space, gym.spaces.Discrete) else None
    cur = np.stack([env.reset(seed=None if seeds is None else seeds[i])[0] for i, env in enumerate(envs)])
    cur = cur.astype(np.float32)  # (N, obs_dim), the current observation of each env
    obs_buf, act_buf, rew_buf = [], [], []
    lengths = np.zeros(n, dtype=np.int64)
    running = np.ones(n, dtype=bool)
    terminated_flags = np.zeros(n, dtype=bool)
    while running.any():
        idx = np.nonzero(running)[0]
        actions = act(torch.as_tensor(cur[idx], dtype=dtype, device=device)).cpu().numpy()
        _check_actions(actions, len(idx), actions_range)
        obs_buf.append(cur.copy())
        step_act, step_rew = np.zeros(n, dtype=np.int64), np.zeros(n)  # float64: rounded to dtype once, below
        for a, i in zip(actions, idx):
            cur[i], step_rew[i], terminated, truncated, _ = envs[i].step(int(a))
            step_act[i] = a
            lengths[i] += 1
            if terminated or truncated:
                running[i] = False
                terminated_flags[i] = terminated
        act_buf.append(step_act)
        rew_buf.append(step_rew)
    T = len(obs_buf)
    t = torch.arange(T, device=device)[:, None]
    lengths_t = torch.as_tensor(lengths, device=device)[None, :]
    return EpisodeBatch(
        obs=torch.as_tensor(np.stack(obs_buf), dtype=dtype, device=device),
        actions=torch.as_tensor(np.stack(act_buf), device=device),
        rewards=torch.as_tensor(np.stack(rew_buf), dtype=dtype, device=device),
        dones=t == lengths_t - 1,
        mask=t < lengths_t,
        terminated=torch.as_tensor(terminated_flags, device=device),
    )


def _check_actions(actions: np.ndarray, count: int, actions_range: tuple[int, int] | None) -> None:
    """``act``'s output for ``count`` envs: one whole action each, in range (``int()`` would turn a probability
    of 0.7 into action 0 without a word)."""
    if actions.shape != (count,):
        raise ValueError(f"act must return one action per running env, shape ({count},), got {actions.shape}.")
    kind = actions.dtype.kind  # checked by kind and on a Python list: about 1.5 µs a step at 8 envs
    if kind not in "iub" and (kind != "f" or (actions != np.round(actions)).any()):  # True pushes right, as int(True)
        raise ValueError(
            f"act must return whole actions (ints), got {actions[:5].tolist()}: probabilities or logits instead of "
            "sampled actions give such values; sample them (torch.distributions.Categorical(...).sample())."
        )
    values = actions.tolist()
    if actions_range is not None and values and (min(values) < actions_range[0] or max(values) >= actions_range[1]):
        raise ValueError(f"act returned actions outside {actions_range[0]}..{actions_range[1] - 1}: {values[:5]}.")


def make_vector_env(env_id: str, num_envs: int, **kwargs) -> gym.vector.VectorEnv:
    """A synchronous vector env with same-step autoreset (see the module docstring for why)."""
    return gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        **kwargs,
    )


def space_sizes(observation_space, action_space, env_id: str) -> tuple[int, int]:
    """``(obs_dim, num_actions)`` for the course's policies: a flat vector of observations and a discrete set of
    actions. Any other env (continuous actions, image observations) gets a ValueError that says which, before a
    network of the wrong shape is built."""
    if isinstance(action_space, gym.spaces.Discrete) and int(action_space.start) != 0:
        raise ValueError(
            f"{env_id}'s actions start at {int(action_space.start)} ({action_space}); the course's policies sample "
            "0..n-1. Shift them with a wrapper (gymnasium.ActionWrapper adding the start) first."
        )
    if not isinstance(action_space, gym.spaces.Discrete):
        raise ValueError(
            f"{env_id} has a {type(action_space).__name__} action space ({action_space}); REINFORCE, A2C and PPO "
            "here sample from a categorical policy, which needs a discrete one (gymnasium.spaces.Discrete), as in "
            "CartPole-v1, Acrobot-v1 or LunarLander-v3. Continuous actions need a Gaussian policy head instead."
        )
    shape = getattr(observation_space, "shape", None)
    if not isinstance(observation_space, gym.spaces.Box) or shape is None or len(shape) != 1:
        raise ValueError(
            f"{env_id} has observations {observation_space}; the course's MLP policies read a flat vector "
            "(a Box of shape (n,)). Flatten them first, e.g. with gymnasium.wrappers.FlattenObservation."
        )
    return int(shape[0]), int(action_space.n)


@dataclass
class Rollout:
    """T steps from N envs; every row is a real transition (s_t, a_t, r_t, s_{t+1}). Time-major."""

    # fmt: off
    obs: torch.Tensor             # (T, N, obs_dim) s_t
    actions: torch.Tensor         # (T, N)
    logprobs: torch.Tensor        # (T, N) log pi(a_t | s_t) when sampled
    rewards: torch.Tensor         # (T, N)
    next_obs: torch.Tensor        # (T, N, obs_dim) the true s_{t+1}: the final observation when step t ended an episode
    terminated: torch.Tensor      # (T, N) bool
    truncated: torch.Tensor       # (T, N) bool
    episode_returns: list[float]  # returns of the episodes that finished during this rollout
    episode_lengths: list[int]
    episode_envs: list[int] | None = None  # the env (column) each of those episodes ran in
    # fmt: on


class _EpisodeCounter:
    """Running return and length per env: tensors on the rollout's device for a torch env (no host syncs per
    step), NumPy arrays for a Gymnasium env (whose rewards arrive as NumPy: no tensor ops per step)."""

    def __init__(self, n: int, device: torch.device, numpy: bool = False):
        self.numpy = numpy
        if numpy:
            wide = torch.get_default_dtype() == torch.float64  # float32 otherwise, as on the torch path
            self.ret = np.zeros(n, dtype=np.float64 if wide else np.float32)
            self.len = np.zeros(n, dtype=np.int64)
        else:
            self.ret = torch.zeros(n, device=device)
            self.len = torch.zeros(n, dtype=torch.long, device=device)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the envs ``rows`` (PPO drops a finished seed's block of envs)."""
        if self.numpy:
            rows = rows.cpu().numpy()
        self.ret, self.len = self.ret[rows], self.len[rows]

    def step(self, rewards, done) -> tuple:
        """Add one step; return (N,) return and length of the episodes that just ended (NaN / -1 elsewhere)."""
        if self.numpy:
            self.ret = self.ret + rewards.astype(self.ret.dtype)
            self.len = self.len + 1
            finished = np.where(done, self.ret, np.nan), np.where(done, self.len, -1)
            self.ret, self.len = np.where(done, 0, self.ret).astype(self.ret.dtype), np.where(done, 0, self.len)
            return finished
        self.ret = self.ret + rewards.to(self.ret.dtype)
        self.len = self.len + 1
        running = ~done
        finished = self.ret.masked_fill(running, float("nan")), self.len.masked_fill(running, -1)
        self.ret, self.len = self.ret.masked_fill(done, 0.0), self.len.masked_fill(done, 0)
        return finished


def _is_torch_env(envs) -> bool:
    return isinstance(getattr(envs, "state", None), torch.Tensor)


def collect_rollout(
    envs, policy, obs, num_steps: int, device: torch.device, counter: _EpisodeCounter | None = None
) -> tuple[Rollout, object, _EpisodeCounter]:
    """Step a same-step-autoreset vector env ``num_steps`` times from ``obs``.

    ``envs`` is a Gymnasium vector env from :func:`make_vector_env` (NumPy in and out) or a torch env
    such as ``edurl.envs.TorchCartPole`` (tensors in and out, already on ``device``). With a torch env the
    loop makes no host<->device copies: episode statistics stay on the device until the rollout ends.
    Returns the rollout, the observation to continue from, and the episode counter to pass back next time.
    """
    torch_env = _is_torch_env(envs)
    dtype = torch.get_default_dtype()  # float32 unless a test asks for float64
    check_count(num_steps, "num_steps", "steps")
    if torch_env and getattr(envs, "autoreset", True) is False:
        raise ValueError(
            "collect_rollout needs an env that resets each finished episode in the same step; this torch env has "
            "autoreset=False, so its finished envs would keep stepping: build it with autoreset=True (the default)."
        )
    if not torch_env:
        autoreset = envs.metadata.get("autoreset_mode")
        if autoreset != gym.vector.AutoresetMode.SAME_STEP:
            raise ValueError(
                f"collect_rollout needs a vector env with SAME_STEP autoreset, got {autoreset}; "
                "build it with edurl.rl.make_vector_env(...)."
            )
    counter = counter or _EpisodeCounter(envs.num_envs, device, numpy=not torch_env)
    keys = ("obs", "actions", "logprobs", "rewards", "next_obs", "terminated", "truncated", "ep_ret", "ep_len")
    buf = {k: [] for k in keys}  # tensors for a torch env; for a Gymnasium env, what it returns stays NumPy
    for _ in range(num_steps):
        obs_t = obs if torch_env else torch.as_tensor(obs, dtype=dtype, device=device)
        actions, logprobs = policy.sample(obs_t)
        if torch_env:
            next_obs, rewards, terminated, truncated, info = envs.step(actions)
            done = terminated | truncated
            # s_{t+1} of a finished episode is its final observation, not the reset one
            true_next = torch.where(done[:, None], info["final_obs"], next_obs)
            obs = next_obs
        else:
            next_obs, rew_np, terminated, truncated, info = envs.step(actions.cpu().numpy())
            done = terminated | truncated
            true_next = np.array(next_obs, dtype=np.float32, copy=True)
            for i in np.nonzero(done)[0]:
                true_next[i] = info["final_obs"][i]
            rewards, obs = rew_np.astype(np.float64 if dtype == torch.float64 else np.float32), next_obs
        ep_ret, ep_len = counter.step(rewards, done)
        for key, value in zip(
            keys, (obs_t, actions, logprobs, rewards, true_next, terminated, truncated, ep_ret, ep_len)
        ):
            buf[key].append(value)
    stacked = {
        k: torch.stack(v) if torch_env or k in ("obs", "actions", "logprobs") else np.stack(v) for k, v in buf.items()
    }
    ep_ret, ep_len = stacked.pop("ep_ret"), stacked.pop("ep_len")
    if not torch_env:  # one host-to-device copy per field for the whole rollout
        ended = np.nonzero(~np.isnan(ep_ret))  # (T, N) in row-major order = time order, then env index
        episodes = ep_ret[ended].tolist(), ep_len[ended].tolist(), ended[1].tolist()
        stacked.update({k: torch.as_tensor(v, device=device) for k, v in stacked.items() if isinstance(v, np.ndarray)})
    else:
        ended = ~torch.isnan(ep_ret)  # (T, N); row-major order = time order, then env index
        episodes = ep_ret[ended].tolist(), ep_len[ended].tolist(), ended.nonzero()[:, 1].tolist()
    stacked["obs"], stacked["next_obs"] = stacked["obs"].to(dtype), stacked["next_obs"].to(dtype)
    stacked["rewards"] = stacked["rewards"].to(dtype)
    return (
        Rollout(**stacked, episode_returns=episodes[0], episode_lengths=episodes[1], episode_envs=episodes[2]),
        obs,
        counter,
    )


def evaluate_policy(
    policy, env_id: str, num_episodes: int, device: torch.device, *, greedy: bool = True, seed: int = 10_000
) -> np.ndarray:
    """Returns of ``num_episodes`` fresh episodes (greedy actions by default), run in batches of up to 16 envs."""
    check_count(num_episodes, "num_episodes", "episodes")
    returns = []
    remaining = num_episodes
    while remaining > 0:
        k = min(16, remaining)
        envs = [gym.make(env_id) for _ in range(k)]
        try:
            batch = collect_episodes(
                envs,
                lambda obs: policy.act(obs, greedy=greedy),
                device,
                seeds=[seed + len(returns) + i for i in range(k)],
            )
        finally:  # an env may hold a window or a process
            for env in envs:
                env.close()
        returns.extend(batch.episode_returns.tolist())
        remaining -= k
    return np.asarray(returns)
