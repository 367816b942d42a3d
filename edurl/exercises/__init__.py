"""Exercise checkers and worked solutions.

In a notebook::

    def discounted_returns(rewards, dones, gamma):
        raise NotImplementedError  # your code here

    verdict = exercises.check_discounted_returns(discounted_returns)
    discounted_returns = verdict.implementation  # yours if it passed, else the reference

and, when stuck, help one level at a time: ``verdict.hint(1)`` (the idea), ``verdict.hint(2)`` (the formula),
``verdict.hint(3)`` (the code of the worked solution); ``exercises.hint("discounted_returns", 1)`` without a
verdict, and ``exercises.show_solution("discounted_returns")`` for the solution straight away.
"""

from __future__ import annotations

import inspect

from edurl.exercises._core import FAILED, NOT_ATTEMPTED, PASSED, Verdict, printed
from edurl.exercises.ch01 import check_bellman_backup, check_discounted_returns
from edurl.exercises.ch02 import check_reinforce_loss, check_reinforce_update
from edurl.exercises.ch03 import check_baseline_losses
from edurl.exercises.ch04 import check_gae
from edurl.exercises.ch05 import check_clip_table, check_clip_values, check_ppo_update
from edurl.exercises.ch06 import check_build_datum
from edurl.exercises.ch07 import (
    check_group_advantages,
    check_grpo_step,
    check_masked_datums,
    check_ppo_loss,
)
from edurl.exercises.ch08 import check_bradley_terry_loss, check_dpo_loss, check_kl_shaped_rewards
from edurl.exercises.ch09 import check_env, check_episode_mask
from edurl.exercises.ch10 import check_offline_step, check_soft_advantages, check_truncated_importance_weights
from edurl.exercises.solutions import ch01 as _ch01_solutions
from edurl.exercises.solutions import ch02 as _ch02_solutions
from edurl.exercises.solutions import ch03 as _ch03_solutions
from edurl.exercises.solutions import ch04 as _ch04_solutions
from edurl.exercises.solutions import ch05 as _ch05_solutions
from edurl.exercises.solutions import ch06 as _ch06_solutions
from edurl.exercises.solutions import ch07 as _ch07_solutions
from edurl.exercises.solutions import ch08 as _ch08_solutions
from edurl.exercises.solutions import ch09 as _ch09_solutions
from edurl.exercises.solutions import ch10 as _ch10_solutions

#: exercise name -> (chapter, checker, worked solution)
EXERCISES = {
    "discounted_returns": (1, check_discounted_returns, _ch01_solutions.discounted_returns),
    "bellman_backup": (1, check_bellman_backup, _ch01_solutions.bellman_backup),
    "reinforce_loss": (2, check_reinforce_loss, _ch02_solutions.reinforce_loss),
    "reinforce_update": (2, check_reinforce_update, _ch02_solutions.reinforce_update),
    "baseline_losses": (3, check_baseline_losses, _ch03_solutions.baseline_losses),
    "gae": (4, check_gae, _ch04_solutions.gae),
    "clip_table": (5, check_clip_table, _ch05_solutions.clip_table),
    "clip_values": (5, check_clip_values, _ch05_solutions.clip_values),
    "ppo_update": (5, check_ppo_update, _ch05_solutions.ppo_update),
    "build_datum": (6, check_build_datum, _ch06_solutions.build_datum),
    "group_advantages": (7, check_group_advantages, _ch07_solutions.group_advantages),
    "ppo_loss": (7, check_ppo_loss, _ch07_solutions.ppo_loss),
    "masked_datums": (7, check_masked_datums, _ch07_solutions.build_datums),
    "grpo_step": (7, check_grpo_step, _ch07_solutions.grpo_step),
    "bradley_terry_loss": (8, check_bradley_terry_loss, _ch08_solutions.bradley_terry_loss),
    "dpo_loss": (8, check_dpo_loss, _ch08_solutions.dpo_loss),
    "kl_shaped_rewards": (8, check_kl_shaped_rewards, _ch08_solutions.kl_shaped_rewards),
    "episode_mask": (9, check_episode_mask, _ch09_solutions.episode_mask),
    "env": (9, check_env, _ch09_solutions.ReverseWordEnv),
    "truncated_importance_weights": (
        10,
        check_truncated_importance_weights,
        _ch10_solutions.truncated_importance_weights,
    ),
    "soft_advantages": (10, check_soft_advantages, _ch10_solutions.soft_advantages),
    "offline_step": (10, check_offline_step, _ch10_solutions.offline_step),
}


def hint(name: str, level: int = 1) -> str:
    """Print (and return) hint ``level`` of exercise ``name``: 1 the idea, 2 the formula, 3 the code."""
    if name not in EXERCISES:
        raise KeyError(f"no exercise named {name!r}; the exercises are: {', '.join(sorted(EXERCISES))}.")
    return printed(EXERCISES[name][1].hints.level(level))


def show_solution(name: str) -> str:
    """Print (and return) the source of the worked solution to exercise ``name``."""
    if name not in EXERCISES:
        raise KeyError(f"no exercise named {name!r}; the exercises are: {', '.join(sorted(EXERCISES))}.")
    return printed(inspect.getsource(EXERCISES[name][2]))


__all__ = [
    "Verdict",
    "PASSED",
    "FAILED",
    "NOT_ATTEMPTED",
    "EXERCISES",
    "show_solution",
    "hint",
    "check_discounted_returns",
    "check_bellman_backup",
    "check_reinforce_loss",
    "check_reinforce_update",
    "check_baseline_losses",
    "check_gae",
    "check_clip_table",
    "check_clip_values",
    "check_ppo_update",
    "check_build_datum",
    "check_group_advantages",
    "check_ppo_loss",
    "check_grpo_step",
    "check_masked_datums",
    "check_bradley_terry_loss",
    "check_dpo_loss",
    "check_kl_shaped_rewards",
    "check_episode_mask",
    "check_env",
    "check_truncated_importance_weights",
    "check_soft_advantages",
    "check_offline_step",
]
