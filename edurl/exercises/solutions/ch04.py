"""Worked solution for Chapter 4. Open it with ``edurl.exercises.show_solution("gae")``."""

import torch


def gae(rewards, values, next_values, terminated, truncated, gamma, lam):
    """Exercise 4.1: GAE(lambda) with termination and truncation kept apart. Returns (advantages, returns)."""
    T = rewards.shape[0]
    # TD error of every step. A terminal next state is worth 0; a truncated one is an ordinary state,
    # so V(final observation), which next_values holds, is bootstrapped.
    not_terminal = (~terminated).to(rewards.dtype)
    deltas = rewards + gamma * next_values * not_terminal - values
    # Either kind of episode end stops the sum: the next row belongs to another episode.
    episode_continues = (~(terminated | truncated)).to(rewards.dtype)
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[0])  # A_{t+1}; 0 after the last step of the rollout
    for t in reversed(range(T)):  # backwards: A_t = delta_t + gamma * lam * A_{t+1}
        next_advantage = deltas[t] + gamma * lam * episode_continues[t] * next_advantage
        advantages[t] = next_advantage
    return advantages, advantages + values
