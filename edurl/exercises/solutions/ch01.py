"""Worked solutions for Chapter 1. Open them with ``edurl.exercises.show_solution(name)``.

They are written to be read: plain loops, one idea per line. The library versions in
``edurl/rl/`` compute the same numbers (vectorised where it helps) and add input checks.
"""

import torch


def discounted_returns(rewards, dones, gamma):
    """Exercise 1.1: reward-to-go G_t = r_t + gamma * G_{t+1}, restarting after each episode end."""
    T = rewards.shape[0]
    returns = torch.zeros_like(rewards)
    # G_{t+1} for every env at once; after the last step of the rollout there is nothing left, so 0.
    next_return = torch.zeros_like(rewards[0])
    # Walk backwards: each G_t needs the G_{t+1} we computed on the previous iteration.
    for t in reversed(range(T)):
        # If step t ended its episode, the return from t+1 belongs to the *next* episode: drop it.
        next_return = torch.where(dones[t], torch.zeros_like(next_return), next_return)
        returns[t] = rewards[t] + gamma * next_return
        next_return = returns[t]
    return returns


def bellman_backup(V, policy, mdp, gamma):
    """Exercise 1.2: V'(s) = sum_a pi(a|s) [R(s,a) + gamma * sum_s' P(s'|s,a) V(s')], with V' = 0 on terminal states."""
    # Arriving in a terminal state ends the episode: no value is collected after it.
    V_next = torch.where(mdp.terminal, torch.zeros_like(V), V)
    # Expected value of the next state for every (s, a): P is (S, A, S'), V_next is (S',).
    expected_next = mdp.P @ V_next  # (S, A)
    Q = mdp.R + gamma * expected_next  # (S, A)
    V_new = (policy * Q).sum(dim=1)  # average over the policy's actions: (S,)
    return torch.where(mdp.terminal, torch.zeros_like(V_new), V_new)
