"""Checkers for Chapter 10's exercises: the truncated importance weight of a stale batch (10.1) and DRO's soft
advantage (10.2). Each compares the learner's function with the library's in ``edurl.llm.losses``."""

from __future__ import annotations

import math

import torch

from edurl.exercises._core import Case, Diagnosis, Hints, Verdict, compare_tensors, run_checker, with_hints
from edurl.exercises.solutions import ch10 as _solutions
from edurl.llm.losses import soft_advantages as _library_soft
from edurl.llm.losses import truncated_importance_weights as _library_tis

__all__ = ["check_soft_advantages", "check_truncated_importance_weights"]


# ================================================================ 10.1 truncated_importance_weights


def _masked(weights, mask):
    return torch.where(mask != 0, weights, torch.zeros_like(weights))


def _inverted(train_logprobs, sampling_logprobs, mask, cap):
    return _library_tis(sampling_logprobs, train_logprobs, mask, cap)


def _untruncated(train_logprobs, sampling_logprobs, mask, cap):
    return _masked(torch.exp(train_logprobs - sampling_logprobs).detach(), mask)


def _two_sided(train_logprobs, sampling_logprobs, mask, cap):
    return _masked(torch.exp(train_logprobs - sampling_logprobs).detach().clamp(1 / cap, cap), mask)


def _ppo_range(train_logprobs, sampling_logprobs, mask, cap):
    return _masked(torch.exp(train_logprobs - sampling_logprobs).detach().clamp(0.8, 1.2), mask)


def _no_exp(train_logprobs, sampling_logprobs, mask, cap):
    return _masked((train_logprobs - sampling_logprobs).detach().clamp(max=cap), mask)


def _capped_log_ratio(train_logprobs, sampling_logprobs, mask, cap):
    return _masked(torch.exp((train_logprobs - sampling_logprobs).detach().clamp(max=cap)), mask)


def _unmasked(train_logprobs, sampling_logprobs, mask, cap):
    return torch.exp(train_logprobs - sampling_logprobs).detach().clamp(max=cap)


def _sequence_ratio(train_logprobs, sampling_logprobs, mask, cap):
    log_ratio = ((train_logprobs - sampling_logprobs) * (mask != 0)).sum(dim=1, keepdim=True).detach()
    return _masked(torch.exp(log_ratio).clamp(max=cap).expand_as(train_logprobs).clone(), mask)


_TIS_DIAGNOSES = [
    Diagnosis(
        _inverted,
        "the ratio is upside down: it is the trainer's probability over the sampler's, pi / q = exp(log pi - log q). "
        "A token the trainer now likes more than the sampler did gets a weight above 1.",
    ),
    Diagnosis(
        _untruncated,
        "the weights are not truncated: a token the sampler found unlikely can get a ratio of 100 or more and swamp "
        "the batch. Cap each weight at `cap`.",
    ),
    Diagnosis(
        _two_sided,
        "you clipped the ratio from below as well. Truncation caps only large weights; a small ratio means the "
        "trainer would rarely sample that token now, and it keeps its small weight.",
    ),
    Diagnosis(
        _ppo_range,
        "you used PPO's range [0.8, 1.2] instead of `cap`: truncation is one-sided, min(ratio, cap), and the "
        "ratio keeps its value below the cap.",
    ),
    Diagnosis(
        _no_exp,
        "the weight is the log-ratio itself: exponentiate the difference of log-probs to get the ratio of "
        "probabilities.",
    ),
    Diagnosis(
        _capped_log_ratio,
        "you capped the log-ratio at `cap` before exponentiating, which caps the ratio at e^cap. Cap the ratio.",
    ),
    Diagnosis(
        _unmasked,
        "the prompt and padding positions got weights: only the sampled tokens (mask 1) have a sampler log-prob "
        "to correct for. Give every other position 0.",
    ),
    Diagnosis(
        _sequence_ratio,
        "you used one ratio per sequence (the product of its tokens' ratios). This exercise weights each token by "
        "its own ratio; a sequence's product of 20 ratios is almost always far outside the cap.",
    ),
]


def _tis_case(name: str, g, B: int, T: int, drift: float, cap: float, dtype=torch.float32) -> Case:
    """Random log-probs, the trainer's ``drift`` away from the sampler's, prompts and padding masked out."""
    sampling = -torch.rand(B, T, generator=g, dtype=dtype) * 4
    mask = torch.zeros(B, T, dtype=dtype)
    for b in range(B):
        start = int(torch.randint(1, T // 2, (1,), generator=g))
        mask[b, start : start + int(torch.randint(1, T - start + 1, (1,), generator=g))] = 1
    train = sampling + torch.randn(B, T, generator=g, dtype=dtype) * drift
    return Case(name, dict(train_logprobs=train, sampling_logprobs=sampling, mask=mask, cap=cap))


def _tis_cases() -> list[Case]:
    g = torch.Generator().manual_seed(101)
    return [
        Case(
            "worked example: log-ratios [0, log 3, -log 2, 3] on the reply, cap 2 -> [1, 2, 0.5, 2]; the prompt's -> 0",
            dict(
                train_logprobs=torch.tensor([[-0.5, -1.0, -2.0 + math.log(3), -3.0 - math.log(2), -1.0]]),
                sampling_logprobs=torch.tensor([[-1.5, -1.0, -2.0, -3.0, -4.0]]),
                mask=torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]]),
                cap=2.0,
            ),
        ),
        _tis_case("4 sequences x 12 positions, one step stale (drift 0.3), cap 2", g, 4, 12, 0.3, 2.0),
        _tis_case("8 sequences x 20 positions, eight steps stale (drift 1.5), cap 5", g, 8, 20, 1.5, 5.0),
        _tis_case("float64, drift 1.0, cap 1.5", g, 3, 10, 1.0, 1.5, torch.float64),
    ]


_HINTS_TIS = Hints(
    idea=(
        "A stale batch was sampled by older weights. Weighting each sampled token by how much more (or less) likely "
        "the current policy makes it turns the old samples into an estimate for the current policy, but one token "
        "the sampler found unlikely can get a huge weight; capping the weight from above keeps the variance "
        "bounded. The weight multiplies a gradient and gets none itself."
    ),
    formula="weights = min(exp(train_logprobs - sampling_logprobs), cap) where mask is 1, else 0; computed from "
    "detached log-probs.",
    solution=_solutions.truncated_importance_weights,
)


@with_hints(_HINTS_TIS)
def check_truncated_importance_weights(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``truncated_importance_weights(train_logprobs, sampling_logprobs, mask, cap)``: (B, T)
    log-probs and mask -> (B, T) weights, without gradient."""

    def compare(got, expected):
        problem = compare_tensors(got, expected, rtol=1e-5, atol=1e-6)
        if problem is None and got.requires_grad:
            return (
                "the weights carry a gradient: the weight scales the policy gradient but is not trained itself; "
                "compute it from detached log-probs (.detach())."
            )
        return problem

    def with_grad(f):
        def call(train_logprobs, sampling_logprobs, mask, cap):
            return f(train_logprobs.clone().requires_grad_(True), sampling_logprobs, mask, cap)

        return call

    return run_checker(
        "Exercise 10.1 truncated_importance_weights",
        fn,
        _library_tis,
        _tis_cases(),
        diagnoses=_TIS_DIAGNOSES,
        compare=compare,
        wrap=with_grad,
        verbose=verbose,
        hints=_HINTS_TIS,
    )


# ================================================================ 10.2 soft_advantages


def _mean_baseline(rewards, tau):
    return rewards - rewards.mean(dim=1, keepdim=True)


def _max_baseline(rewards, tau):
    return rewards - rewards.max(dim=1, keepdim=True).values


def _sum_not_mean(rewards, tau):
    return rewards - tau * torch.logsumexp(rewards / tau, dim=1, keepdim=True)


def _tau_missing_outside(rewards, tau):
    return rewards - (torch.logsumexp(rewards / tau, dim=1, keepdim=True) - math.log(rewards.shape[1]))


def _tau_multiplied(rewards, tau):
    return rewards - torch.log(torch.exp(rewards * tau).mean(dim=1, keepdim=True)) / tau


def _whole_batch(rewards, tau):
    return rewards - tau * (torch.logsumexp(rewards.flatten() / tau, dim=0) - math.log(rewards.numel()))


def _naive_exp(rewards, tau):
    return rewards - tau * torch.log(torch.exp(rewards / tau).mean(dim=1, keepdim=True))


_SOFT_DIAGNOSES = [
    Diagnosis(
        _mean_baseline,
        "you subtracted the group mean: that is GRPO's advantage, the limit of a very large tau. DRO's baseline is "
        "a soft maximum that leans toward the group's best rewards as tau gets small.",
    ),
    Diagnosis(
        _max_baseline,
        "you subtracted the group's maximum: that is the limit tau -> 0. For tau > 0 the baseline is the soft "
        "maximum, tau times the log of the mean of exp(R / tau), which lies between the mean and the maximum.",
    ),
    Diagnosis(
        _sum_not_mean,
        "the baseline uses the log of a sum over the group, not of a mean: it is too high by tau * log G, so "
        "every advantage is pushed down by the group size.",
    ),
    Diagnosis(
        _tau_missing_outside,
        "tau is missing outside the log: the soft maximum is tau * log mean exp(R / tau), in the rewards' units.",
    ),
    Diagnosis(
        _tau_multiplied,
        "tau is used the other way round: the rewards are divided by tau inside the exp, and the log is multiplied "
        "by tau outside it.",
    ),
    Diagnosis(
        _whole_batch,
        "the soft maximum is taken over the whole batch; take it over each group (each row), as GRPO's mean is.",
    ),
    Diagnosis(
        _naive_exp,
        "the result overflows for a small tau: exp(R / tau) is inf in float32 once R / tau passes about 88. Take "
        "each group's largest value out of the exp before the mean, and add it back after the log.",
    ),
]


def _soft_cases() -> list[Case]:
    g = torch.Generator().manual_seed(102)
    verifier = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [-0.1, 0.0, 1.0, -0.1]])
    return [
        Case(
            "worked example: rewards [[1, 0]], tau 1 -> [[0.380, -0.620]]",
            dict(rewards=torch.tensor([[1.0, 0.0]]), tau=1.0),
        ),
        Case("verifier rewards (1, 0, -0.1), groups of 4, tau 0.5", dict(rewards=verifier, tau=0.5)),
        Case("16 groups of 8 random rewards, tau 2", dict(rewards=torch.randn(16, 8, generator=g), tau=2.0)),
        Case("a small tau: 0.01, rewards up to 1 (exp(R / tau) = exp(100))", dict(rewards=verifier, tau=0.01)),
        Case(
            "float64, 4 groups of 6, tau 0.25",
            dict(rewards=torch.rand(4, 6, generator=g, dtype=torch.float64), tau=0.25),
        ),
    ]


_HINTS_SOFT = Hints(
    idea=(
        "GRPO compares each completion with its group's mean reward. DRO compares it with a soft maximum of the "
        "group's rewards, whose softness tau is the same number as the loss's beta: for a large tau it is the mean, "
        "for a small one the best reward in the group. Compute it per group, and keep the exp from overflowing."
    ),
    formula="A[p, g] = R[p, g] - tau * log( (1/G) * sum_g' exp(R[p, g'] / tau) ), computed with the group's "
    "largest R / tau taken out of the exp and added back after the log.",
    solution=_solutions.soft_advantages,
)


@with_hints(_HINTS_SOFT)
def check_soft_advantages(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``soft_advantages(rewards, tau)``: (P, G) rewards and tau > 0 -> (P, G) advantages."""
    return run_checker(
        "Exercise 10.2 soft_advantages",
        fn,
        _library_soft,
        _soft_cases(),
        diagnoses=_SOFT_DIAGNOSES,
        compare=lambda got, expected: compare_tensors(got, expected, rtol=1e-5, atol=1e-5),
        verbose=verbose,
        hints=_HINTS_SOFT,
    )
