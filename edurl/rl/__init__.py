"""Classic RL, one readable file per idea. Rollout tensors are time-major: (T, N).

- ``returns.py``: discounted reward-to-go (Chapter 1).
- ``tabular.py``: Bellman backups, policy evaluation and value iteration on known MDPs (Chapter 1).
- ``advantages.py``: TD errors and GAE with termination vs truncation (Chapter 4).
- ``networks.py``, ``rollout.py``, ``episodes.py``: MLPs, experience collection, the solve rule.
- ``reinforce.py`` (Chapter 2), ``a2c.py`` (Chapter 3) and ``ppo.py`` (Chapter 5): the trainers.
"""

from edurl.objectives import clipped_surrogate
from edurl.rl.a2c import A2CConfig, train_a2c
from edurl.rl.advantages import gae, td_errors
from edurl.rl.episodes import TrainResult, solved_at
from edurl.rl.networks import CategoricalPolicy, ValueNet, mlp
from edurl.rl.ppo import PPOConfig, ppo_diagnostics, train_ppo
from edurl.rl.reinforce import ReinforceConfig, reinforce_loss, reinforce_update, train_reinforce
from edurl.rl.returns import discounted_returns
from edurl.rl.rollout import EpisodeBatch, Rollout, collect_episodes, collect_rollout, evaluate_policy, make_vector_env
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
    "td_errors",
    "gae",
    "TabularMDP",
    "q_values",
    "bellman_backup",
    "policy_evaluation",
    "solve_policy_values",
    "value_iteration",
    "greedy_policy",
    "uniform_policy",
    "monte_carlo_value",
    "mlp",
    "CategoricalPolicy",
    "ValueNet",
    "EpisodeBatch",
    "Rollout",
    "collect_episodes",
    "collect_rollout",
    "make_vector_env",
    "evaluate_policy",
    "solved_at",
    "TrainResult",
    "ReinforceConfig",
    "reinforce_loss",
    "reinforce_update",
    "train_reinforce",
    "A2CConfig",
    "train_a2c",
    "PPOConfig",
    "clipped_surrogate",
    "ppo_diagnostics",
    "train_ppo",
]
