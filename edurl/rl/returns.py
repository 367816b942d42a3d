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

    returns = torch.empty_like(rewards)
    running = rewards.new_zeros(rewards.shape[1:])  # G_{t+1}, one entry per env; (N,)
    for t in range(rewards.shape[0] - 1, -1, -1):  # backwards in time: G_t needs G_{t+1}
        # where the episode ended, nothing after it flows back (a where, not a product with 0: 0 * nan is nan)
        running = rewards[t] + torch.where(dones[t], 0.0, gamma * running)
        returns[t] = running
    return returns
