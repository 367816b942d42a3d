"""TD errors and Generalized Advantage Estimation (Schulman et al., 2016, "High-Dimensional Continuous
Control Using Generalized Advantage Estimation"). Taught in Chapter 4, used by A2C (Chapter 3) and PPO (Chapter 5).

All tensors are time-major ``(T, N)``. Two kinds of episode end are kept apart (Chapter 1):

- ``terminated[t]``: s_{t+1} is an end state. Its value is 0, so nothing is bootstrapped.
- ``truncated[t]``: a time limit cut the episode after step t. s_{t+1} was an ordinary state, so its
  value V(s_{t+1}) is bootstrapped. ``next_values[t]`` must be V of that *final* observation, never
  of the observation the env was reset to.

Either way, the advantage of step t never accumulates anything from the next episode.
"""

from __future__ import annotations

import torch

from edurl._checks import check_gamma, check_same_shape, check_tensor
from edurl.rl.returns import sum_within_episodes

__all__ = ["td_errors", "gae"]


_NONE_MEANS = {"terminated": "no step reached an end state", "truncated": "no time limit cut an episode"}


def _check_rollout(rewards, values, next_values, terminated, truncated=None, *, needs_truncated=False):
    check_tensor(rewards, "rewards", ndim=(1, 2), floating=True)
    for name, x in (("values", values), ("next_values", next_values)):
        check_tensor(x, name, floating=True)
        check_same_shape(rewards, x, "rewards", name)
    for name, x, needed in (("terminated", terminated, True), ("truncated", truncated, needs_truncated)):
        if x is None and needed:
            raise TypeError(
                f"{name} is None; pass a bool tensor shaped like rewards, "
                f"torch.zeros_like(rewards, dtype=torch.bool) if {_NONE_MEANS[name]}"
            )
        if x is not None:
            check_tensor(x, name, boolean=True)
            check_same_shape(rewards, x, "rewards", name)


def td_errors(
    rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor, terminated: torch.Tensor, gamma: float
) -> torch.Tensor:
    """One-step TD errors: delta_t = r_t + gamma * V(s_{t+1}) * (1 - terminated_t) - V(s_t).

    ===========  ======  ====================================================================
    argument     shape   meaning
    ===========  ======  ====================================================================
    rewards      (T, N)  reward of step t
    values       (T, N)  V(s_t)
    next_values  (T, N)  V(s_{t+1}), the true next observation (the final one at a truncation)
    terminated   (T, N)  bool, s_{t+1} is an end state: its value counts as 0
    returns      (T, N)  delta_t
    ===========  ======  ====================================================================

    Truncation needs no argument here: a truncated step bootstraps like any other.
    """
    _check_rollout(rewards, values, next_values, terminated)
    gamma = check_gamma(gamma)
    # an end state's value counts as 0 whatever the critic says there (a fill: 0 * nan and 0 * inf are nan)
    return rewards + (gamma * next_values).masked_fill(terminated, 0.0) - values


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(lambda) advantages and the matching value targets.

    A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1},  done_t = terminated_t or truncated_t,  A_T = 0,
    where delta_t comes from :func:`td_errors` (bootstrapping through truncation, never termination).

    Returns ``(advantages, returns)``, both (T, N), with ``returns = advantages + values``.
    lam = 0 gives the TD errors; lam = 1 gives the discounted return (bootstrapped only at the
    rollout's end and at truncations) minus V(s_t).

    Hand-computed example (gamma = lam = 1, one env, V = 0 except next_values[1] = 10):
    rewards [1, 1, 1], terminated [F, F, F], truncated [F, T, F] gives deltas [1, 11, 1 + next_values[2]]
    and advantages [12, 11, delta_2]: the truncation at t = 1 bootstraps 10 and stops the sum.
    """
    _check_rollout(rewards, values, next_values, terminated, truncated, needs_truncated=True)
    lam = check_gamma(lam, "lam")
    deltas = td_errors(rewards, values, next_values, terminated, gamma)
    carry = (~(terminated | truncated)).to(rewards.dtype) * (gamma * lam)  # 0 at every episode end
    advantages = torch.empty_like(deltas)
    running = deltas.new_zeros(deltas.shape[1:])  # A_{t+1}, one per env: (N,)
    for t in range(deltas.shape[0] - 1, -1, -1):  # backwards: A_t needs A_{t+1}
        running = deltas[t] + carry[t] * running
        advantages[t] = running
    if not torch.isfinite(advantages).all():  # 0 * inf and 0 * nan are nan: a non-finite delta crossed an end
        advantages = sum_within_episodes(deltas, gamma * lam, terminated | truncated)
    return advantages, advantages + values
