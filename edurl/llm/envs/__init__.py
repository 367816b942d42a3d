"""Multi-turn environments and tool use (Chapter 9), in the Tinker Cookbook's shapes.

* ``base``          -- ``Env``, ``StepResult``, ``Transition``, ``Trajectory``, ``EnvGroupBuilder``, ``MessageEnv``,
  the batched rollout (``do_group_rollouts``) and episodes as datums (``trajectory_to_datums``)
* ``guess_number``  -- the guess-the-number game, its scripted players and their exact win rates
* ``calculator``    -- 3-digit addition with a calculator tool and its safe parser
"""

from edurl.llm.envs.base import (
    Env,
    EnvGroupBuilder,
    MessageEnv,
    ProblemGroupBuilder,
    StepResult,
    StopCondition,
    TokensWithLogprobs,
    Trajectory,
    TrajectoryGroup,
    Transition,
    do_group_rollout,
    do_group_rollouts,
    do_group_rollouts_async,
    extends,
    groups_to_datums,
    is_prefix_consistent,
    merged_datum,
    per_turn_datums,
    play_actions,
    rollout_metrics,
    trajectory_to_datums,
)
from edurl.llm.envs.calculator import CalculatorEnv, CalculatorGroupBuilder, ToolError, calculate
from edurl.llm.envs.guess_number import GuessNumberEnv, GuessNumberGroupBuilder

__all__ = [
    "CalculatorEnv",
    "CalculatorGroupBuilder",
    "Env",
    "EnvGroupBuilder",
    "GuessNumberEnv",
    "GuessNumberGroupBuilder",
    "MessageEnv",
    "ProblemGroupBuilder",
    "StepResult",
    "StopCondition",
    "TokensWithLogprobs",
    "ToolError",
    "Trajectory",
    "TrajectoryGroup",
    "Transition",
    "calculate",
    "do_group_rollout",
    "do_group_rollouts",
    "do_group_rollouts_async",
    "extends",
    "groups_to_datums",
    "is_prefix_consistent",
    "merged_datum",
    "per_turn_datums",
    "play_actions",
    "rollout_metrics",
    "trajectory_to_datums",
]
