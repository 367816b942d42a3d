"""Discounted returns (reward-to-go) over time-major rollouts. Taught in Chapter 1, used from Chapter 2 on.

For one episode, G_t = r_t + gamma * G_{t+1}, with G = 0 after the last step. A rollout packs
several episodes one after another in each column of a ``(T, N)`` tensor; ``dones[t]`` marks the
last step of an episode, where the sum must restart. Nothing is bootstrapped: an episode cut off at
the end of the rollout just sums the rewards it has (Chapter 4 adds value bootstrapping).
"""

from __future__ import annotations

import torch

from edurl._checks import check_gamma, check_same_shape, check_tensor

__all__ = ["discounted_returns"]


def discounted_returns(rewards: torch.Tensor, dones: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go for each step, restarting after every episode end.

    ==========  ========  ==========================================================
    argument    shape     meaning
    ==========  ========  ==========================================================
    rewards     (T, N)    float reward received at step t in env n (or (T,) for one env)
    dones       (T, N)    bool, True if step t was the last step of its episode
    gamma       scalar    discount factor in [0, 1]
    returns     (T, N)    G_t = r_t + gamma * G_{t+1} * (1 - done_t); same dtype and device as rewards
    ==========  ========  ==========================================================

    Example (hand-computed, gamma = 0.5): rewards [1, 1, 1], dones [F, T, F] gives
    [1 + 0.5*1, 1, 1] = [1.5, 1, 1]; the episode ends at t = 1, so G_1 does not see r_2.
    """
    check_tensor(rewards, "rewards", ndim=(1, 2), floating=True)
    check_tensor(dones, "dones", boolean=True)
    check_same_shape(rewards, dones, "rewards", "dones")
    gamma = check_gamma(gamma)

    keep = (~dones).to(rewards.dtype)  # 0 where the episode ended: nothing after it flows back
    returns = torch.empty_like(rewards)
    running = rewards.new_zeros(rewards.shape[1:])  # G_{t+1}, one entry per env; (N,)
    for t in range(rewards.shape[0] - 1, -1, -1):  # backwards in time: G_t needs G_{t+1}
        running = rewards[t] + gamma * keep[t] * running
        returns[t] = running
    if not torch.isfinite(returns).all():  # 0 * inf and 0 * nan are nan: a non-finite reward crossed an end
        returns = sum_within_episodes(rewards, gamma, dones)
    return returns


def sum_within_episodes(x: torch.Tensor, factor: float, ends: torch.Tensor) -> torch.Tensor:
    """``y_t = x_t + factor * y_{t+1}``, with nothing carried back past a step where ``ends`` is True: the slow,
    exact form of the loops in :func:`discounted_returns` and :func:`edurl.rl.advantages.gae`, which multiply by
    0 at an end and so carry a NaN or inf back across it (0 * inf is nan). They fall back on this when their
    result is not finite; on finite inputs both forms give the same numbers."""
    out = torch.empty_like(x)
    running = x.new_zeros(x.shape[1:])
    for t in range(x.shape[0] - 1, -1, -1):
        running = x[t] + (factor * running).masked_fill(ends[t], 0.0)
        out[t] = running
    return out
