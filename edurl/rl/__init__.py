"""Classic RL, one readable file per idea. Rollout tensors are time-major: (T, N).

- ``returns.py``: discounted reward-to-go (Chapter 1).
- ``tabular.py``: Bellman backups, policy evaluation and value iteration on known MDPs (Chapter 1).
"""

from edurl.rl.returns import discounted_returns
from edurl.rl.tabular import (
    TabularMDP,
    bellman_backup,
    greedy_policy,
    monte_carlo_value,
    policy_evaluation,
    q_values,
    solve_policy_values,
    uniform_policy,
    value_iteration,
)

__all__ = [
    "discounted_returns",
    "TabularMDP",
    "q_values",
    "bellman_backup",
    "policy_evaluation",
    "solve_policy_values",
    "value_iteration",
    "greedy_policy",
    "uniform_policy",
    "monte_carlo_value",
]
