"""Checker for Chapter 4's exercise: GAE with termination and truncation (4.1)."""

from __future__ import annotations

import torch

from edurl.exercises._core import Case, Diagnosis, Hints, Verdict, compare_outputs, run_checker, with_hints
from edurl.exercises.solutions import ch04 as _solutions
from edurl.rl.advantages import gae as _reference

__all__ = ["check_gae"]

_NO_TRUNC_BOOTSTRAP = (
    "at a truncation you did not bootstrap. The episode was cut off by a time limit, not ended: "
    "delta_t must include gamma * next_values[t] there. Only `terminated` zeroes it."
)


def _through_terminal(rewards, values, next_values, terminated, truncated, gamma, lam):
    # treats every step as non-terminal in delta, but still stops the sum at episode ends
    none = torch.zeros_like(terminated)
    return _reference(rewards, values, next_values, none, terminated | truncated, gamma, lam)


def _truncation_as_termination(rewards, values, next_values, terminated, truncated, gamma, lam):
    return _reference(rewards, values, next_values, terminated | truncated, torch.zeros_like(truncated), gamma, lam)


def _across_boundaries(rewards, values, next_values, terminated, truncated, gamma, lam):
    deltas = rewards + gamma * next_values * (~terminated) - values
    adv, running = torch.zeros_like(rewards), torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        running = deltas[t] + gamma * lam * running
        adv[t] = running
    return adv, adv + values


def _forward(rewards, values, next_values, terminated, truncated, gamma, lam):
    deltas = rewards + gamma * next_values * (~terminated) - values
    keep = ~(terminated | truncated)
    adv, running = torch.zeros_like(rewards), torch.zeros_like(rewards[0])
    for t in range(rewards.shape[0]):
        running = deltas[t] + gamma * lam * running
        adv[t] = running
        running = running * keep[t]
    return adv, adv + values


def _returns_without_values(rewards, values, next_values, terminated, truncated, gamma, lam):
    adv, _ = _reference(rewards, values, next_values, terminated, truncated, gamma, lam)
    return adv, adv


def _stop_only_at_termination(rewards, values, next_values, terminated, truncated, gamma, lam):
    adv, _ = _reference(rewards, values, next_values, terminated, torch.zeros_like(truncated), gamma, lam)
    return adv, adv + values


_DIAGNOSES = [
    Diagnosis(
        _through_terminal,
        "you bootstrap through a terminal state. When terminated[t] is True, s_{t+1} "
        "is an end state worth 0: delta_t = r_t - V(s_t).",
    ),
    Diagnosis(_truncation_as_termination, _NO_TRUNC_BOOTSTRAP),
    Diagnosis(
        _stop_only_at_termination,
        "the sum runs across a truncation into the next episode. Truncation "
        "bootstraps in delta_t, but it still ends the episode: reset the running "
        "advantage at terminated OR truncated.",
    ),
    Diagnosis(
        _across_boundaries,
        "the advantage accumulates across episode boundaries. Multiply the carried "
        "A_{t+1} by 0 when step t ended an episode (terminated or truncated).",
    ),
    Diagnosis(_forward, "the recursion runs forwards. A_t depends on the *future*: loop t = T-1, ..., 0."),
    Diagnosis(_returns_without_values, "returns should be advantages + values (the value targets)."),
]


def _cases() -> list[Case]:
    T, F = True, False
    g = torch.Generator().manual_seed(4)

    def col(*xs, dtype=torch.float32):
        return torch.tensor([[x] for x in xs], dtype=dtype)

    cases = [
        Case(
            "one episode, no ends",
            dict(
                rewards=col(1.0, 1.0, 1.0),
                values=col(0.5, 0.4, 0.3),
                next_values=col(0.4, 0.3, 0.2),
                terminated=col(F, F, F, dtype=torch.bool),
                truncated=col(F, F, F, dtype=torch.bool),
                gamma=0.9,
                lam=0.8,
            ),
        ),
        Case(
            "termination in the middle",
            dict(
                rewards=col(1.0, 1.0, 1.0),
                values=col(0.5, 0.4, 0.3),
                next_values=col(0.4, 9.0, 0.2),
                terminated=col(F, T, F, dtype=torch.bool),
                truncated=col(F, F, F, dtype=torch.bool),
                gamma=0.9,
                lam=0.8,
            ),
        ),
        Case(
            "truncation in the middle",
            dict(
                rewards=col(1.0, 1.0, 1.0),
                values=col(0.5, 0.4, 0.3),
                next_values=col(0.4, 9.0, 0.2),
                terminated=col(F, F, F, dtype=torch.bool),
                truncated=col(F, T, F, dtype=torch.bool),
                gamma=0.9,
                lam=0.8,
            ),
        ),
    ]
    two_envs = dict(
        rewards=torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0], [1.0, 0.5]]),
        values=torch.tensor([[0.2, 0.1], [0.3, 0.2], [0.1, 0.4], [0.6, 0.3]]),
        next_values=torch.tensor([[0.3, 0.2], [0.1, 5.0], [0.6, 0.3], [0.9, 0.8]]),
        terminated=torch.tensor([[F, F], [F, F], [T, F], [F, F]]),
        truncated=torch.tensor([[F, F], [F, T], [F, F], [F, F]]),
        gamma=0.99,
    )
    cases += [
        Case("two envs, lam = 1 (Monte Carlo returns minus the values)", dict(two_envs, lam=1.0)),
        Case("two envs, lam = 0 (each advantage is its one-step TD error)", dict(two_envs, lam=0.0)),
    ]
    for i, (steps, envs) in enumerate([(12, 3), (64, 8)]):
        # values as a real rollout has them: next_values[t] is values[t + 1] inside an episode, and a fresh value
        # (of the final observation) where one ended; independent draws once failed a correct lambda-return form
        terminated = torch.rand(steps, envs, generator=g) < 0.1
        truncated = (torch.rand(steps, envs, generator=g) < 0.1) & ~terminated
        table = torch.randn(steps + 1, envs, generator=g)
        final = torch.randn(steps, envs, generator=g)
        cases.append(
            Case(
                f"random rollout {steps}x{envs}",
                dict(
                    rewards=torch.randn(steps, envs, generator=g),
                    values=table[:-1],
                    next_values=torch.where(terminated | truncated, final, table[1:]),
                    terminated=terminated,
                    truncated=truncated,
                    gamma=[0.99, 0.95][i],
                    lam=[0.95, 0.5][i],
                ),
            )
        )
    last = cases[-2].kwargs  # the 12x3 rollout again in float64: the advantages keep the inputs' dtype
    cases.append(
        Case(
            "the random 12x3 rollout in float64",
            {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in last.items()},
        )
    )
    # one long episode in float32: (gamma * lam) ** (t - k) over all pairs (a matrix form) overflows for k > t
    steps = 500
    table = torch.randn(steps + 1, 1, generator=g)
    cases.append(
        Case(
            "a 500-step episode in float32, lam = 0.5",
            dict(
                rewards=torch.randn(steps, 1, generator=g),
                values=table[:-1],
                next_values=table[1:],
                terminated=torch.zeros(steps, 1, dtype=torch.bool),
                truncated=torch.zeros(steps, 1, dtype=torch.bool),
                gamma=0.99,
                lam=0.5,
            ),
        )
    )
    return cases


_HINTS_GAE = Hints(
    idea=(
        "First each step's one-step TD error, bootstrapping from the next state's value unless the episode "
        "terminated there. Then sum the TD errors backwards in time, each step discounted by gamma * lambda, "
        "restarting wherever an episode ended. The value targets are the advantages plus the values."
    ),
    formula="delta_t = r_t + gamma * V(s_{t+1}) * (1 - terminated_t) - V(s_t); "
    "A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1}, backwards; "
    "returns = A + values.",
    solution=_solutions.gae,
)


@with_hints(_HINTS_GAE)
def check_gae(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``gae(rewards, values, next_values, terminated, truncated, gamma, lam)``."""
    return run_checker(
        "Exercise 4.1 gae",
        fn,
        _reference,
        _cases(),
        diagnoses=_DIAGNOSES,
        compare=compare_outputs(["advantages", "returns"], rtol=1e-5, atol=1e-5),
        verbose=verbose,
        hints=_HINTS_GAE,
    )
