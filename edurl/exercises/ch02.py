"""Checker for Chapter 2's exercise: the REINFORCE loss with return normalisation (2.1)."""

from __future__ import annotations

import torch

from edurl.exercises._core import Case, Diagnosis, Verdict, compare_outputs, run_checker
from edurl.exercises._grad import with_gradients
from edurl.rl.reinforce import reinforce_loss as _library_loss

__all__ = ["check_reinforce_loss"]


def _reference(logprobs, returns):
    return _library_loss(logprobs, returns, normalize_advantages=True)


def _no_minus(logprobs, returns):
    return -_reference(logprobs, returns)


def _not_normalised(logprobs, returns):
    return _library_loss(logprobs, returns, normalize_advantages=False)


def _centred_only(logprobs, returns):
    return -(logprobs * (returns - returns.mean())).mean()


def _population_std(logprobs, returns):
    return -(logprobs * (returns - returns.mean()) / (returns.std(unbiased=False) + 1e-8)).mean()


def _no_epsilon(logprobs, returns):
    return -(logprobs * (returns - returns.mean()) / returns.std()).mean()


def _summed(logprobs, returns):
    return _reference(logprobs, returns) * logprobs.numel()


def _probabilities(logprobs, returns):
    return _reference(logprobs.exp(), returns)


_DIAGNOSES = [
    Diagnosis(
        _no_minus,
        "the sign is flipped. Optimisers minimise, and we want to *increase* sum log pi * G: return the negative.",
    ),
    Diagnosis(_not_normalised, "the returns are not normalised: use (G - G.mean()) / (G.std() + 1e-8)."),
    Diagnosis(_centred_only, "you subtracted the mean but did not divide by the std (+ 1e-8)."),
    Diagnosis(_population_std, "use torch's default returns.std() (the unbiased one), not std(unbiased=False)."),
    Diagnosis(_no_epsilon, "when every return is equal, the std is 0 and you divide by zero: add 1e-8 to the std."),
    Diagnosis(_summed, "take the mean over steps, not the sum: the loss should not grow with the batch size."),
    Diagnosis(
        _probabilities, "use the log-probabilities as given; the gradient estimator needs grad log pi, not grad pi."
    ),
]


def _cases() -> list[Case]:
    g = torch.Generator().manual_seed(2)
    cases = [
        Case("three steps", dict(logprobs=torch.tensor([-0.5, -1.0, -2.0]), returns=torch.tensor([1.0, 2.0, 3.0]))),
        Case(
            "returns all equal (std = 0)", dict(logprobs=torch.tensor([-0.3, -0.9]), returns=torch.tensor([5.0, 5.0]))
        ),
        Case(
            "negative returns",
            dict(logprobs=torch.tensor([-0.1, -0.7, -0.2, -1.5]), returns=torch.tensor([-3.0, 1.0, -0.5, 0.0])),
        ),
    ]
    for n in (10, 200):
        cases.append(
            Case(
                f"random batch of {n}",
                dict(logprobs=-torch.rand(n, generator=g) * 3, returns=torch.randn(n, generator=g) * 20 + 40),
            )
        )
    return cases


def check_reinforce_loss(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``reinforce_loss(logprobs, returns)``: its value and its gradient."""
    return run_checker(
        "Exercise 2.1 reinforce_loss",
        fn,
        _reference,
        _cases(),
        diagnoses=_DIAGNOSES,
        wrap=with_gradients(["loss"], [("loss", 0)]),
        compare=compare_outputs(["loss", "d loss / d logprobs"], rtol=1e-4, atol=1e-6),
        verbose=verbose,
        default_hint="loss = -mean(logprobs * (G - G.mean()) / (G.std() + 1e-8)), "
        "with no gradient through the returns.",
    )
