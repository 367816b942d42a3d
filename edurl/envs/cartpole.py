"""CartPole-v1 in torch, batched over ``num_envs``: the same physics as Gymnasium's, on any device.

The constants, the Euler integration, the termination thresholds and the 500-step time limit follow
Gymnasium's ``CartPoleEnv`` (Barto, Sutton & Anderson, 1983; equations from Florian, 2007), and a
test checks step-for-step agreement in float64. Being a tensor program, a whole batch steps at once,
on a GPU if you like, and any state can be set directly (``env.state = ...``) to start Monte Carlo
rollouts from chosen states (Chapter 4). Used by PPO in Chapter 5.

Autoreset is same-step: an env that finishes is reset inside ``step``, the observation returned is
the new episode's first, and the finished episode's last observation is in ``info["final_obs"]``
(``autoreset=False`` leaves finished envs as they are, for code that plays whole episodes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral

import torch

from edurl._checks import check_count, check_tensor, is_whole

__all__ = ["TorchCartPole"]


class TorchCartPole:
    gravity = 9.8
    masscart = 1.0
    masspole = 0.1
    total_mass = masspole + masscart
    length = 0.5  # half the pole's length
    polemass_length = masspole * length
    force_mag = 10.0
    tau = 0.02  # seconds between state updates
    theta_threshold_radians = 12 * 2 * math.pi / 360
    x_threshold = 2.4
    obs_dim, num_actions = 4, 2

    def __init__(
        self,
        num_envs: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        max_episode_steps: int = 500,
        autoreset: bool = True,
        check_actions: bool = True,
    ):
        check_count(num_envs, "num_envs", "envs")
        num_envs = int(num_envs)  # a NumPy int too
        if dtype is None:  # the default dtype, as a policy built beside the env has
            dtype = torch.get_default_dtype()
            if dtype not in (torch.float32, torch.float64):
                raise ValueError(
                    f"TorchCartPole's dtype defaults to torch.get_default_dtype(), which is {dtype}; CartPole runs in "
                    "torch.float32 or torch.float64: pass dtype=torch.float32."
                )
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}.")
        for name, flag in (("autoreset", autoreset), ("check_actions", check_actions)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {type(flag).__name__} {flag!r}.")
        if not is_whole(max_episode_steps) or max_episode_steps < 1:
            raise ValueError(
                f"max_episode_steps must be a positive int (CartPole-v1's is 500), got {max_episode_steps!r}."
            )
        self.num_envs, self.device, self.dtype = num_envs, torch.device(device), dtype
        self.max_episode_steps = max_episode_steps
        self.autoreset = autoreset
        """False: an env that finishes is not reset (no random draw); it keeps stepping from where it ended, and
        the caller ignores it until the next ``reset`` (REINFORCE plays whole episodes this way). Past its end such
        an env still pays 1 a step, and ``terminated`` can turn False again if the cart comes back inside the
        bounds (Gymnasium pays 0 there): read nothing of an env after the step that ended it."""
        self.check_actions = check_actions
        """True: ``step`` refuses an action other than 0 or 1 (it would push left without a word). Each check reads
        the actions back to the host, a sync on a GPU and about a tenth of a step at 8 envs on a CPU, so the course's
        trainers, whose actions are 0 or 1 by construction, turn it off."""
        self._state = torch.zeros(num_envs, 4, device=self.device, dtype=dtype)
        self._started = False  # by reset() or a state set by hand: step() before either is refused, as in Gymnasium
        self.elapsed = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        """(num_envs,) steps taken in the current episode (for the time limit)."""
        self._gens = [torch.Generator(device=self.device)]
        self._gens[0].seed()
        self._forces = torch.tensor([-self.force_mag, self.force_mag], device=self.device, dtype=dtype)
        self._thresholds = torch.tensor(
            [self.x_threshold, self.theta_threshold_radians], device=self.device, dtype=dtype
        )

    @property
    def state(self) -> torch.Tensor:
        """(num_envs, 4): cart position, cart velocity, pole angle, pole angular velocity.

        Settable, to start rollouts from chosen states (Chapter 4): ``env.state = states`` with ``states`` of shape
        (num_envs, 4) in the env's dtype and on its device. Setting it starts new episodes from those states, so the
        step counts of the time limit go back to 0."""
        return self._state

    @state.setter
    def state(self, states: torch.Tensor) -> None:
        check_tensor(states, "env.state")
        if states.shape != (self.num_envs, 4):
            fix = (
                f"for {states.shape[0]} states build TorchCartPole({states.shape[0]}, ...)"
                if states.dim() == 2 and states.shape[1] == 4
                else "a state is 4 numbers (x, x_dot, theta, theta_dot); one state is states.reshape(1, 4)"
            )
            raise ValueError(
                f"env.state must have shape ({self.num_envs}, 4), one row of 4 per env, got {tuple(states.shape)}: {fix}."
            )
        # against where the env's tensors are: an env built on "cuda" holds them on "cuda:0"
        if states.dtype != self.dtype or states.device != self._state.device:
            raise ValueError(
                f"env.state must be {self.dtype} on {self._state.device} (the env's), got {states.dtype} on "
                f"{states.device}: "
                "use states.to(env.dtype) or .to(env.device), or build the env with that dtype and device."
            )
        self._state = states.clone()
        self.elapsed = torch.zeros(self.num_envs, dtype=torch.long, device=self.device)
        self._started = True

    def _random_states(self, n: int) -> torch.Tensor:
        if len(self._gens) == 1:
            u = torch.rand(n, 4, generator=self._gens[0], device=self.device, dtype=self.dtype)
        else:  # one block of rows per generator, each drawn as its own env of n / G rows would draw it
            rows = n // len(self._gens)
            u = torch.cat([torch.rand(rows, 4, generator=g, device=self.device, dtype=self.dtype) for g in self._gens])
        return u * 0.1 - 0.05  # uniform in [-0.05, 0.05), as Gymnasium

    def reset(self, seed: int | Sequence[int] | None = None) -> tuple[torch.Tensor, dict]:
        """Fresh start states for every env. ``seed`` is an int, or a list of G ints: then the envs form G
        equal blocks, block g with its own generator seeded ``seed[g]``, so block g behaves exactly as a
        ``TorchCartPole(num_envs // G)`` reset with ``seed[g]`` (how PPO runs several seeds in one env)."""
        if isinstance(seed, (str, bytes, bool, float)):
            raise TypeError(f"seed must be an int, a list of ints or None, got {type(seed).__name__} {seed!r}")
        if hasattr(seed, "tolist") and not isinstance(seed, Integral):
            seed = seed.tolist()  # a tensor or NumPy array: a 0-d one gives an int, a 1-d one a list
        if isinstance(seed, Sequence):
            if not seed or self.num_envs % len(seed):
                raise ValueError(
                    f"reset(seed=[...]) needs a non-empty list whose length divides num_envs ({self.num_envs}), "
                    f"got {len(seed)} seeds."
                )
            self._gens = [torch.Generator(device=self.device).manual_seed(_seed(s)) for s in seed]
        elif seed is not None:
            self._gens = [torch.Generator(device=self.device).manual_seed(_seed(seed))]  # NumPy ints too
        self._state = self._random_states(self.num_envs)
        self.elapsed = torch.zeros(self.num_envs, dtype=torch.long, device=self.device)
        self._started = True
        return self._state.clone(), {}

    def keep_blocks(self, blocks: Sequence[int]) -> None:
        """After ``reset(seed=[...])`` with G seeds: keep only the blocks ``blocks`` (in this order), each with its
        state, step count and generator as they are. PPO drops the envs of a seed that has finished this way."""
        blocks = list(blocks)
        if not blocks or any(not isinstance(b, Integral) or not 0 <= b < len(self._gens) for b in blocks):
            raise ValueError(
                f"keep_blocks needs a non-empty list of block indices in 0..{len(self._gens) - 1} (one block per seed "
                f"given to reset), got {blocks}."
            )
        if len(set(blocks)) < len(blocks):  # two blocks would share one generator: neither the run of its seed
            raise ValueError(f"keep_blocks got a block index twice ({blocks}); keep each block at most once.")
        size = self.num_envs // len(self._gens)
        rows = torch.cat([torch.arange(b * size, (b + 1) * size, device=self.device) for b in blocks])
        self._state, self.elapsed = self._state[rows], self.elapsed[rows]
        self._gens = [self._gens[b] for b in blocks]
        self.num_envs = len(blocks) * size

    def close(self) -> None:
        """Nothing to release (no window, no process); here so that code written for Gymnasium's envs runs."""

    def step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """Advance every env one step. ``actions`` is (num_envs,) of 0 (push left) or 1 (push right)."""
        if not isinstance(actions, torch.Tensor) or actions.shape != (self.num_envs,):
            got = tuple(actions.shape) if isinstance(actions, torch.Tensor) else type(actions).__name__
            raise ValueError(
                f"actions must be a tensor of shape ({self.num_envs},), got {got}"
                + (": use torch.as_tensor(actions)." if not isinstance(actions, torch.Tensor) else ".")
            )
        if not self._started:
            raise RuntimeError(
                "call env.reset(seed=...) (or assign env.state = states) before env.step(): no episode has begun."
            )
        if self.check_actions:
            bad = (actions != 0) & (actions != 1)
            if bool(bad.any()):
                shown = actions[bad][:5].tolist()
                raise ValueError(
                    f"actions must be 0 (push left) or 1 (push right), got {shown}{' ...' if int(bad.sum()) > 5 else ''}"
                    f" in {int(bad.sum())} of {self.num_envs} envs. A policy over more actions than CartPole's 2, or "
                    "sampled probabilities instead of actions, gives such values."
                )
        # Gymnasium's equations, each line one or two tensor ops: with 8 envs on a CPU a step is all per-op
        # overhead (benchmarks/README.md), and on a GPU each op is a kernel launch
        x_dot, theta, theta_dot = self._state[:, 1], self._state[:, 2], self._state[:, 3]
        force = torch.where(actions.to(self.device) == 1, self._forces[1], self._forces[0])  # 1 pushes right
        costheta, sintheta = torch.cos(theta), torch.sin(theta)
        temp = torch.addcmul(force, theta_dot.square(), sintheta, value=self.polemass_length).div_(self.total_mass)
        thetaacc = torch.addcmul(sintheta * self.gravity, costheta, temp, value=-1.0).div_(
            costheta.square().mul_(-self.length * self.masspole / self.total_mass).add_(self.length * 4.0 / 3.0)
        )
        xacc = torch.addcmul(temp, thetaacc, costheta, value=-self.polemass_length / self.total_mass)
        # Euler: positions move with the *old* velocities
        new_state = torch.add(self._state, torch.stack([x_dot, xacc, theta_dot, thetaacc], dim=-1), alpha=self.tau)
        self.elapsed = self.elapsed + 1
        terminated = (new_state[:, ::2].abs() > self._thresholds).any(-1)  # |x| > 2.4 or |theta| > 12 degrees
        truncated = self.elapsed >= self.max_episode_steps
        reward = torch.ones(self.num_envs, device=self.device, dtype=self.dtype)  # +1 on every step, the last included
        done = terminated | truncated
        final_obs = new_state
        if self.autoreset:  # same-step autoreset, without a host sync: finished rows get a fresh start state
            self._state = torch.where(done[:, None], self._random_states(self.num_envs), new_state)
            self.elapsed = self.elapsed.masked_fill(done, 0)
        else:
            self._state = new_state.clone()
        return self._state.clone(), reward, terminated, truncated, {"final_obs": final_obs, "_final_obs": done}


def _seed(value) -> int:
    """One seed for a generator: a non-negative int (a NumPy int too), as Gymnasium asks, below 2**64, the most a
    ``torch.Generator`` takes (Gymnasium takes larger ones)."""
    if not is_whole(value) or value < 0:
        raise ValueError(f"each seed must be a non-negative int, got {type(value).__name__} {value!r}.")
    if value >= 2**64:
        raise ValueError(f"each seed must be below 2**64 (a torch.Generator's range), got {value}; use seed % 2**64.")
    return int(value)
