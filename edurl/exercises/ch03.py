"""Checker for Chapter 3's exercise: REINFORCE with a learned value baseline (3.1)."""

from __future__ import annotations

import torch

from edurl.exercises._core import Case, Diagnosis, Hints, Verdict, compare_outputs, run_checker, with_hints
from edurl.exercises._grad import with_gradients
from edurl.exercises.solutions import ch03 as _solutions

__all__ = ["check_baseline_losses", "baseline_losses"]


def baseline_losses(logprobs: torch.Tensor, returns: torch.Tensor, values: torch.Tensor):
    """Reference: policy loss -mean(logprobs * (G - V).detach()), value loss 0.5 * mean((V - G)^2)."""
    policy_loss = -(logprobs * (returns - values).detach()).mean()
    value_loss = 0.5 * ((values - returns) ** 2).mean()
    return policy_loss, value_loss


def _critic_not_detached(logprobs, returns, values):
    return -(logprobs * (returns - values)).mean(), 0.5 * ((values - returns) ** 2).mean()


def _flipped_advantage(logprobs, returns, values):
    return -(logprobs * (values - returns).detach()).mean(), baseline_losses(logprobs, returns, values)[1]


def _no_baseline(logprobs, returns, values):
    return -(logprobs * returns).mean(), baseline_losses(logprobs, returns, values)[1]


_DIAGNOSES = [
    Diagnosis(
        _critic_not_detached,
        "the policy loss sends gradients into the critic. Use (returns - values).detach() "
        "as the advantage: the baseline must stay a constant for the policy gradient.",
    ),
    Diagnosis(
        _flipped_advantage,
        "the policy loss has the wrong sign: either the advantage is upside down (it is G_t - V(s_t), better than "
        "expected is positive) or the loss lacks its minus sign (minimise -mean(log pi * (G_t - V(s_t))): the two "
        "give the same numbers.",
    ),
    Diagnosis(_no_baseline, "the policy loss ignores the baseline: weight log pi by G_t - V(s_t), not G_t."),
]


def _cases() -> list[Case]:
    g = torch.Generator().manual_seed(3)
    cases = [
        Case(
            "three steps",
            dict(
                logprobs=torch.tensor([-0.5, -1.0, -2.0]),
                returns=torch.tensor([1.0, 2.0, 3.0]),
                values=torch.tensor([1.5, 1.5, 1.5]),
            ),
        )
    ]
    for n in (8, 100):
        cases.append(
            Case(
                f"random batch of {n}",
                dict(
                    logprobs=-torch.rand(n, generator=g) * 3,
                    returns=torch.randn(n, generator=g) * 10 + 30,
                    values=torch.randn(n, generator=g) * 10 + 25,
                ),
            )
        )
    return cases


_HINTS_BASELINE_LOSSES = Hints(
    idea=(
        "Two losses. The policy's weights each log-probability by the advantage, how much better the return "
        "was than the critic's guess, held fixed so no gradient reaches the critic through it. The critic's "
        "is a regression of its value onto the observed return."
    ),
    formula="policy_loss = -mean(logprobs * (returns - values).detach()); "
    "value_loss = 0.5 * mean((values - returns)**2).",
    solution=_solutions.baseline_losses,
)


@with_hints(_HINTS_BASELINE_LOSSES)
def check_baseline_losses(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``baseline_losses(logprobs, returns, values) -> (policy_loss, value_loss)``, with gradients."""
    return run_checker(
        "Exercise 3.1 baseline_losses",
        fn,
        baseline_losses,
        _cases(),
        diagnoses=_DIAGNOSES,
        wrap=with_gradients(["policy_loss", "value_loss"], [("policy_loss", 0), ("policy_loss", 2), ("value_loss", 2)]),
        compare=compare_outputs(
            [
                "policy_loss",
                "value_loss",
                "d policy_loss / d logprobs",
                "d policy_loss / d values (should be 0)",
                "d value_loss / d values",
            ],
            rtol=1e-4,
            atol=1e-6,
        ),
        verbose=verbose,
        hints=_HINTS_BASELINE_LOSSES,
    )
