"""Checkers for Chapter 7's exercises: group advantages (7.1), one group's masked training datums (7.2), the
per-token PPO loss (7.3) and the capstone, a whole GRPO step (7.4), which runs on the first two. Each compares the
learner's function with the library's reference."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import torch

from edurl.exercises._core import (
    FAILED,
    NOT_ATTEMPTED,
    PASSED,
    Case,
    CheckFailure,
    Diagnosis,
    Hints,
    Verdict,
    _where_it_raised,
    compare_outputs,
    compare_tensors,
    finish,
    run_checker,
    with_hints,
)
from edurl.exercises._grad import call_on_leaves
from edurl.exercises.ch06 import datum_shifted_by_prompt_length, datum_with_unmasked_prompt
from edurl.exercises.solutions import ch07 as _solutions
from edurl.llm.clients import AdamParams, Future
from edurl.llm.datum import DATUM_FIELDS, Datum
from edurl.llm.datum import build_datum as _library_build_datum
from edurl.llm.losses import group_advantages as _library_group_advantages
from edurl.llm.losses import ppo as _library_ppo

__all__ = ["check_group_advantages", "check_grpo_step", "check_masked_datums", "check_ppo_loss"]


# ================================================================ 7.1 group_advantages


def _reference_group_advantages(rewards):
    return _library_group_advantages(rewards, scale="none")


def _batch_mean(rewards):
    return rewards - rewards.mean()


def _mean_over_prompts(rewards):
    return rewards - rewards.mean(dim=0, keepdim=True)


def _no_keepdim(rewards):
    # (P, G) - (P,) broadcasts the P group means along the G axis; it only runs when P == G (or P == 1)
    return rewards - rewards.mean(dim=1)


def _group_std_scaled(rewards):
    return _library_group_advantages(rewards, scale="group")


def _group_std_no_eps(rewards):
    return (rewards - rewards.mean(dim=1, keepdim=True)) / rewards.std(dim=1, keepdim=True)


def _group_population_std(rewards):
    return (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True, unbiased=False) + 1e-6)


def _std_scaled(eps: float, unbiased: bool):
    """Centred, then divided by the group's std plus ``eps`` (the epsilons learners reach for)."""
    return lambda rewards: (
        (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True, unbiased=unbiased) + eps)
    )


def _raw_rewards(rewards):
    return rewards.clone()


_STD_HINT = (
    "you divided by a std (the group's, as GRPO scales, or the batch's). This exercise asks for centring only, as "
    "in Dr. GRPO: "
    "A = R - mean over the group, with no division (which also avoids 0 / 0 = NaN on a group whose rewards "
    "are all equal)."
)

_GROUP_ADVANTAGES_DIAGNOSES = [
    Diagnosis(_raw_rewards, "you returned the rewards unchanged: subtract each group's mean reward."),
    Diagnosis(_group_std_scaled, _STD_HINT),
    Diagnosis(_group_std_no_eps, _STD_HINT),
    Diagnosis(_group_population_std, _STD_HINT),
    *(Diagnosis(_std_scaled(eps, unbiased), _STD_HINT) for eps in (1e-4, 1e-5, 1e-8) for unbiased in (True, False)),
    Diagnosis(
        _batch_mean,
        "you subtracted the mean over the whole batch. The baseline is per group: each prompt's "
        "completions are compared with each other, rewards.mean(dim=1, keepdim=True).",
    ),
    Diagnosis(
        _mean_over_prompts,
        "you took the mean over dim=0, across prompts for each sample index. A group is a "
        "row of the (P, G) rewards: use rewards.mean(dim=1, keepdim=True).",
    ),
    Diagnosis(
        _no_keepdim,
        "rewards.mean(dim=1) has shape (P,), and (P, G) - (P,) broadcasts it along the wrong "
        "axis (sample g gets group g's mean). Keep the group axis: mean(dim=1, keepdim=True).",
    ),
]


def _group_advantages_cases() -> list[Case]:
    g = torch.Generator().manual_seed(71)
    binary = (torch.rand(8, 16, generator=g) < 0.5).float()  # (P, G) pass/fail rewards
    binary[2] = 1.0  # an all-correct group and an all-wrong one, as a verifier gives on easy and hard prompts
    binary[5] = 0.0
    return [
        # hand-computed: mean 0.625, so [1 - .625, .5 - .625, 0 - .625, 1 - .625]
        Case(
            "worked example: one group [1, .5, 0, 1] -> [.375, -.125, -.625, .375]",
            dict(rewards=torch.tensor([[1.0, 0.5, 0.0, 1.0]])),
        ),
        # means 1/3, 1, 0.5 -> [[2/3, -1/3, -1/3], [0, 0, 0], [-.5, .5, 0]]
        Case(
            "3 prompts x 3 samples, one group all correct",
            dict(rewards=torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.5]])),
        ),
        Case(
            "every group has equal rewards (all advantages 0)",
            dict(rewards=torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])),
        ),
        Case("8 prompts x 16 pass/fail samples", dict(rewards=binary)),
        Case(
            "4 prompts x 5 real-valued rewards, float64",
            dict(rewards=torch.randn(4, 5, generator=g, dtype=torch.float64) * 3 + 2),
        ),
    ]


_HINTS_GROUP_ADVANTAGES = Hints(
    idea=(
        "Each row is one prompt's group of completions. A completion's advantage is how much better its "
        "reward is than what its own group got on average, and a group that all got the same reward teaches "
        "nothing."
    ),
    formula="A = rewards - rewards.mean(dim=1, keepdim=True): row p is prompt p's group of "
    "G completions; no division by the std.",
    solution=_solutions.group_advantages,
)


@with_hints(_HINTS_GROUP_ADVANTAGES)
def check_group_advantages(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``group_advantages(rewards)``: (P, G) rewards -> (P, G) rewards minus each group's mean."""
    return run_checker(
        "Exercise 7.1 group_advantages",
        fn,
        _reference_group_advantages,
        _group_advantages_cases(),
        diagnoses=_GROUP_ADVANTAGES_DIAGNOSES,
        compare=lambda got, expected: compare_tensors(got, expected, rtol=1e-5, atol=1e-6),
        verbose=verbose,
        hints=_HINTS_GROUP_ADVANTAGES,
    )


# ================================================================ 7.3 ppo_loss


def _reference_ppo(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    return _library_ppo(train_logprobs, sampling_logprobs, advantages, clip_low_threshold, clip_high_threshold)


def _ppo_max(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    ratio = torch.exp(train_logprobs - sampling_logprobs)
    return -torch.max(ratio * advantages, ratio.clamp(clip_low_threshold, clip_high_threshold) * advantages)


def _ppo_no_minus(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    return -_reference_ppo(train_logprobs, sampling_logprobs, advantages, clip_low_threshold, clip_high_threshold)


def _ppo_always_clipped(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    return -(torch.exp(train_logprobs - sampling_logprobs).clamp(clip_low_threshold, clip_high_threshold) * advantages)


def _ppo_never_clipped(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    return -(torch.exp(train_logprobs - sampling_logprobs) * advantages)


def _ppo_ratio_of_logprobs(
    train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2
):
    ratio = train_logprobs / sampling_logprobs
    return -torch.min(ratio * advantages, ratio.clamp(clip_low_threshold, clip_high_threshold) * advantages)


def _ppo_inverted_ratio(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    ratio = torch.exp(sampling_logprobs - train_logprobs)
    return -torch.min(ratio * advantages, ratio.clamp(clip_low_threshold, clip_high_threshold) * advantages)


def _ppo_clip_advantage(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    ratio = torch.exp(train_logprobs - sampling_logprobs)
    return -torch.min(ratio * advantages, ratio * advantages.clamp(clip_low_threshold, clip_high_threshold))


def _ppo_clip_product(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    ratio = torch.exp(train_logprobs - sampling_logprobs)
    return -torch.min(ratio * advantages, (ratio * advantages).clamp(clip_low_threshold, clip_high_threshold))


def _ppo_bounds_as_eps(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    ratio = torch.exp(train_logprobs - sampling_logprobs)
    return -torch.min(ratio * advantages, ratio.clamp(1 - clip_low_threshold, 1 + clip_high_threshold) * advantages)


def _ppo_detached_ratio(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    return _reference_ppo(
        train_logprobs.detach(), sampling_logprobs, advantages, clip_low_threshold, clip_high_threshold
    )


_PPO_DIAGNOSES = [
    Diagnosis(
        _ppo_no_minus,
        "the sign is flipped. min(r*A, clip(r)*A) is an objective to *maximise*; optimisers "
        "minimise, so the loss is its negative.",
    ),
    Diagnosis(
        _ppo_detached_ratio,
        "the gradient is zero everywhere: the ratio was detached from train_logprobs "
        "(.detach(), .item(), torch.no_grad() or a NumPy round trip). The whole point of "
        "r = exp(train_logprobs - sampling_logprobs) is that its gradient flows into train_logprobs.",
    ),
    Diagnosis(
        _ppo_max,
        "you took max() instead of min(). PPO is pessimistic: it keeps the *smaller* of r*A and "
        "clip(r)*A, which removes the incentive to move r past the range in the direction A favours.",
    ),
    Diagnosis(
        _ppo_always_clipped,
        "you return -clip(r)*A without the min(), so the gradient is zero whenever r is "
        "outside [clip_low_threshold, clip_high_threshold], on both sides. min(r*A, clip(r)*A) keeps the "
        "unclipped term where it is smaller, so a move that undoes a bad step keeps its "
        "gradient (A > 0 with r < clip_low_threshold, A < 0 with r > clip_high_threshold).",
    ),
    Diagnosis(
        _ppo_never_clipped,
        "nothing is clipped: this is the plain importance-sampling loss -r*A. Take "
        "-min(r*A, clamp(r, clip_low_threshold, clip_high_threshold)*A).",
    ),
    Diagnosis(
        _ppo_ratio_of_logprobs,
        "the ratio is of probabilities, not log-probabilities: r = pi / pi_sampler = "
        "exp(train_logprobs - sampling_logprobs), not train_logprobs / sampling_logprobs.",
    ),
    Diagnosis(
        _ppo_inverted_ratio,
        "the ratio is upside down: r = pi / pi_sampler = exp(train_logprobs - sampling_logprobs)"
        ", not exp(sampling_logprobs - train_logprobs).",
    ),
    Diagnosis(
        _ppo_clip_advantage,
        "you clipped the advantage. Clip the ratio: clamp(r, clip_low_threshold, clip_high_threshold) * A.",
    ),
    Diagnosis(
        _ppo_clip_product,
        "you clipped the product r*A. Clip the ratio alone, then multiply: "
        "clamp(r, clip_low_threshold, clip_high_threshold) * A.",
    ),
    Diagnosis(
        _ppo_bounds_as_eps,
        "clip_low_threshold and clip_high_threshold bound the ratio itself (0.8 and 1.2 for PPO's eps = 0.2): "
        "clamp(r, clip_low_threshold, clip_high_threshold), not clamp(r, 1 - clip_low_threshold, 1 + clip_high_threshold).",
    ),
]


def _per_token_loss_and_grad(fn):
    """Run ``fn`` on a fresh leaf ``train_logprobs`` and return (per-token loss, d sum(loss) / d train_logprobs).

    Each token's loss depends on its own log-prob only, so the gradient of the sum is the per-token gradient.
    A loss with no graph back to ``train_logprobs`` gets a zero gradient, which the diagnoses can then name.
    """

    def run(train_logprobs, sampling_logprobs, advantages, *clip_range):
        train_logprobs = train_logprobs.detach().clone().requires_grad_(True)
        loss = call_on_leaves(fn, train_logprobs, sampling_logprobs, advantages, *clip_range)
        if isinstance(loss, torch.Tensor) and loss.shape != train_logprobs.shape:
            hint = (
                " Do not reduce it (no .mean() or .sum()): aggregation over tokens comes later."
                if loss.numel() == 1
                else ""
            )
            raise CheckFailure(
                f"expected the per-token loss, shape {tuple(train_logprobs.shape)} like train_logprobs, got shape "
                f"{tuple(loss.shape)}.{hint}"
            )
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return loss, torch.zeros_like(train_logprobs)
        (grad,) = torch.autograd.grad(loss.sum(), train_logprobs, allow_unused=True)
        return loss.detach(), torch.zeros_like(train_logprobs) if grad is None else grad

    return run


def _ppo_cases() -> list[Case]:
    g = torch.Generator().manual_seed(72)
    # ratios below, inside and above [0.8, 1.2] (and beyond [0.2, 2.2]); row 0 has A = +2, row 1 A = -0.5
    ratios = torch.tensor([0.1, 0.5, 1.0, 1.5, 3.0])
    q = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.5], [-0.7, -1.2, -2.5, -0.3, -4.0]])  # (2, 5)
    # hand-computed: A = +2 -> loss -2r below and inside, -2.4 above (gradient -2r, -2r, -2r, 0, 0);
    #                A = -0.5 -> loss 0.4 below (gradient 0), 0.5r inside and above (gradient 0.5r)
    cases = [
        Case(
            "ratios 0.1 .. 3 with A = +2 (row 0) and A = -0.5 (row 1)",
            dict(
                train_logprobs=q + ratios.log(),
                sampling_logprobs=q,
                advantages=torch.tensor([[2.0] * 5, [-0.5] * 5]),
                clip_low_threshold=0.8,
                clip_high_threshold=1.2,
            ),
        ),
    ]
    q = -torch.rand(3, 6, generator=g) * 4
    cases.append(
        Case(
            "on-policy: train_logprobs == sampling_logprobs (r = 1)",
            dict(
                train_logprobs=q.clone(),
                sampling_logprobs=q,
                advantages=torch.randn(3, 6, generator=g),
                clip_low_threshold=0.8,
                clip_high_threshold=1.2,
            ),
        )
    )
    q = -torch.rand(4, 16, generator=g) * 4
    cases.append(
        Case(
            "4 x 16 tokens, default clip range (no clip arguments passed)",
            dict(
                train_logprobs=q + torch.randn(4, 16, generator=g) * 0.3,
                sampling_logprobs=q,
                advantages=torch.randn(4, 16, generator=g),
            ),
        )
    )
    q = -torch.rand(8, 32, generator=g) * 4
    cases.append(
        Case(
            "8 x 32 tokens, asymmetric range [0.8, 1.28] (DAPO's clip-higher)",
            dict(
                train_logprobs=q + torch.randn(8, 32, generator=g) * 0.3,
                sampling_logprobs=q,
                advantages=torch.randn(8, 1, generator=g).expand(8, 32).clone(),
                clip_low_threshold=0.8,
                clip_high_threshold=1.28,
            ),
        )
    )
    q = -torch.rand(2, 3, 10, generator=g, dtype=torch.float64) * 4
    cases.append(
        Case(
            "(P, G, T) = (2, 3, 10) tokens in float64, range [0.9, 1.1]",
            dict(
                train_logprobs=q + torch.randn(2, 3, 10, generator=g, dtype=torch.float64) * 0.2,
                sampling_logprobs=q,
                advantages=torch.randn(2, 3, 1, generator=g, dtype=torch.float64).expand(2, 3, 10).clone(),
                clip_low_threshold=0.9,
                clip_high_threshold=1.1,
            ),
        )
    )
    return cases


_HINTS_PPO_LOSS = Hints(
    idea=(
        "Per token, the ratio of the new policy's probability to the sampler's. Of the plain and the clipped "
        "objective take the more pessimistic one, keep one value per token, and negate it for the optimiser."
    ),
    formula="r = exp(train_logprobs - sampling_logprobs); loss = -min(r * A, clamp(r, clip_low_threshold, "
    "clip_high_threshold) * A), one value per token, with the gradient flowing through r.",
    solution=_solutions.ppo_loss,
)


@with_hints(_HINTS_PPO_LOSS)
def check_ppo_loss(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's per-token ``ppo_loss(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8,
    clip_high_threshold=1.2)``: its values and its gradient with respect to ``train_logprobs``."""
    return run_checker(
        "Exercise 7.3 ppo_loss",
        fn,
        _reference_ppo,
        _ppo_cases(),
        diagnoses=_PPO_DIAGNOSES,
        wrap=_per_token_loss_and_grad,
        compare=compare_outputs(["per-token loss", "d loss / d train_logprobs"], rtol=1e-4, atol=1e-6),
        verbose=verbose,
        hints=_HINTS_PPO_LOSS,
    )


# ================================================================ 7.2 build_datums

_FIELDS = ("model_input", *DATUM_FIELDS)


def _reference_build_datums(prompt_tokens, completions, advantages):
    return [
        _library_build_datum(prompt_tokens, tokens, train_logprobs, advantage)
        for (tokens, train_logprobs), advantage in zip(completions, advantages)
    ]


def _per_completion(build_one):
    """A group builder that applies a (buggy) one-completion builder to every completion."""

    def build(prompt_tokens, completions, advantages):
        return [
            build_one(prompt_tokens, tokens, train_logprobs, advantage)
            for (tokens, train_logprobs), advantage in zip(completions, advantages)
        ]

    return build


def _first_advantage_everywhere(prompt_tokens, completions, advantages):
    return _reference_build_datums(prompt_tokens, completions, [advantages[0]] * len(completions))


def _advantage_on_last_token(prompt_tokens, completions, advantages):
    datums = []
    for d in _reference_build_datums(prompt_tokens, completions, advantages):
        adv = d.loss_fn_inputs["advantages"]
        only_last = torch.zeros_like(adv)
        only_last[-1] = adv[-1]  # the reward arrives at the last token, but every action shares the credit
        datums.append(Datum(d.model_input, {**d.loss_fn_inputs, "advantages": only_last}))
    return datums


_DATUMS_DIAGNOSES = [
    Diagnosis(
        _per_completion(datum_with_unmasked_prompt),
        "the prompt is not masked: prompt tokens were not sampled by the "
        "policy, so their advantage and mask must be 0.",
    ),
    Diagnosis(
        _per_completion(datum_shifted_by_prompt_length),
        "off by one: the first sampled token is predicted at "
        "position len(prompt) - 1 (from the last prompt token), so the "
        "prompt contributes len(prompt) - 1 zeros, not len(prompt).",
    ),
    Diagnosis(
        _first_advantage_everywhere,
        "every completion got the same advantage (advantages[0]). Completion i "
        "gets advantages[i]: zip(completions, advantages).",
    ),
    Diagnosis(
        _advantage_on_last_token,
        "only the last token carries the advantage. The completion's advantage "
        "applies to every sampled token: A on each position where mask is 1.",
    ),
]


def _datums_as_rows(fn):
    """Run ``fn`` and lay each Datum out as one float tensor of rows (model_input, *DATUM_FIELDS), shape (5, L)."""

    def run(prompt_tokens, completions, advantages):
        datums = fn(prompt_tokens, completions, advantages)
        if isinstance(datums, Datum):
            raise CheckFailure(
                f"expected a list of Datums, one per completion ({len(completions)}), got a single "
                "Datum. Build one for each (tokens, sampling_logprobs) pair in completions."
            )
        if not isinstance(datums, (list, tuple)):
            extra = " (did you forget the `return` statement?)" if datums is None else ""
            if isinstance(datums, Iterator):  # the step of 7.4 takes len() of a batch, and reads it more than once
                extra = " (a generator, used up once read: return a list, [... for ...] or list(...))"
            raise CheckFailure(f"expected a list of Datums, got {type(datums).__name__}{extra}.")
        if len(datums) != len(completions):
            raise CheckFailure(f"expected one Datum per completion, {len(completions)}, got {len(datums)}.")
        rows = []
        for i, datum in enumerate(datums):
            if not isinstance(datum, Datum):
                raise CheckFailure(
                    f"element {i} is a {type(datum).__name__}, not a Datum. Return "
                    "Datum(model_input=ModelInput.from_ints(...), loss_fn_inputs={...})."
                )
            missing = [k for k in DATUM_FIELDS if k not in datum.loss_fn_inputs]
            if missing:
                raise CheckFailure(f"datum {i}: loss_fn_inputs lacks {missing}; it needs {list(DATUM_FIELDS)}.")
            rows.append(
                torch.stack(
                    [
                        torch.tensor(datum.model_input.to_ints(), dtype=torch.float32),
                        *(torch.as_tensor(datum.loss_fn_inputs[k]).float() for k in DATUM_FIELDS),
                    ]
                )
            )
        return tuple(rows)

    return run


def _compare_datums(got: tuple, expected: tuple) -> str | None:
    for i, (g, e) in enumerate(zip(got, expected)):
        if g.shape != e.shape:
            return f"datum {i}: expected {e.shape[1]} positions (len(prompt) + len(completion) - 1), got {g.shape[1]}."
        problem = compare_outputs(_FIELDS, rtol=1e-6, atol=1e-6)(tuple(g), tuple(e))
        if problem:
            return f"datum {i}, {problem} Each datum is shown below as the rows {', '.join(_FIELDS)}."
    return None


def _datums_cases() -> list[Case]:
    g = torch.Generator().manual_seed(73)
    cases = [
        Case(
            "3-token prompt, 2 completions with advantages +0.5 and -0.5",
            dict(
                prompt_tokens=[10, 11, 12],
                completions=[([20, 21], [-0.5, -0.25]), ([22, 23, 24], [-1.0, -0.1, -2.0])],
                advantages=[0.5, -0.5],
            ),
        ),
        Case(
            "1-token prompt, 4 completions (one a single token)",
            dict(
                prompt_tokens=[7],
                completions=[
                    ([8, 9], [-1.0, -2.0]),
                    ([3], [-0.4]),
                    ([5, 6, 2], [-0.3, -0.2, -0.9]),
                    ([4, 4], [-1.5, -0.6]),
                ],
                advantages=[0.75, -0.25, -0.25, -0.25],
            ),
        ),
        Case(
            "zero-variance group: every advantage 0",
            dict(
                prompt_tokens=[3, 1, 4, 1, 5],
                completions=[([9, 2], [-0.1, -0.2]), ([6, 5, 3], [-0.3, -0.4, -0.5])],
                advantages=[0.0, 0.0],
            ),
        ),
    ]
    n_prompt, lengths = 20, torch.randint(1, 13, (8,), generator=g).tolist()
    rewards = (torch.rand(1, 8, generator=g) < 0.5).float()
    rewards[0, :2] = torch.tensor([0.0, 1.0])  # never a zero-variance group
    cases.append(
        Case(
            f"random {n_prompt}-token prompt, group of 8 completions",
            dict(
                prompt_tokens=torch.randint(5, 100, (n_prompt,), generator=g).tolist(),
                completions=[
                    (torch.randint(5, 100, (n,), generator=g).tolist(), (-torch.rand(n, generator=g) * 3).tolist())
                    for n in lengths
                ],
                advantages=_library_group_advantages(rewards)[0].tolist(),
            ),
        )
    )
    return cases


_HINTS_BUILD_DATUMS = Hints(
    idea="One datum per completion, exactly as in exercise 6.1, each carrying its own completion's advantage.",
    formula="for completion i: tokens = prompt + completion; model_input = tokens[:-1]; "
    "target_tokens = tokens[1:]; train_logprobs, advantages and mask are 0 on the "
    "len(prompt) - 1 prompt targets, then the sampled log-probs, advantages[i], "
    "and 1.",
    solution=_solutions.build_datums,
)


@with_hints(_HINTS_BUILD_DATUMS)
def check_masked_datums(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``build_datums(prompt_tokens, completions, advantages)``: one masked Datum per completion
    of a group, ``completions`` being (tokens, sampling_logprobs) pairs and ``advantages`` one float each."""
    return run_checker(
        "Exercise 7.2 build_datums",
        fn,
        _reference_build_datums,
        _datums_cases(),
        diagnoses=_DATUMS_DIAGNOSES,
        compare=_compare_datums,
        wrap=_datums_as_rows,
        verbose=verbose,
        hints=_HINTS_BUILD_DATUMS,
    )


# ================================================================ 7.4 grpo_step (the capstone)
#
# The checker runs the learner's step and the library's grpo_step for two steps each, from the same weights, through
# trainers that record every call: the samplers made and what they drew, the datums and arguments of forward_backward,
# its loss, the gradients handed to optim_step and its AdamParams. A mistake is named from what it did to those records
# (a sampler older than the last update, advantages that do not sum to zero within a group, a mask on the prompt,
# ...), so a learner's code may be laid out in any order and still be recognised.

#: the checked steps' settings: 8 problems x 4 completions (P != G, so a group laid out across problems shows)
STEP_CHECK = dict(
    batch_size=8,
    group_size=4,
    learning_rate=1e-3,
    max_steps=2,
    temperature=0.9,
    max_tokens=11,
    loss_fn="ppo",
    aggregation="seq_mean_token_mean",
    progress=False,
)
"""The checked steps' settings, each away from GRPOConfig's default so that a value written into the step instead of
read from the config shows: the temperature (0.9, not 1.0: a step that samples or scores at the default gets another
gradient; one that left it out once passed), the loss and the aggregation, and ``max_tokens``. 11 tokens cut off the
replies whose sum has three digits (12 tokens with the end of turn), so their reward holds the format term's penalty
and differs from their correctness: with Chapter 6's checkpoint, which boxes every answer, advantages taken from the
correctness once passed."""


@dataclasses.dataclass
class _StepLog:
    samplers_made: int = 0
    samples: list = dataclasses.field(default_factory=list)  # (prompts, responses, sampler age) per sample call
    forward_backward: list = dataclasses.field(default_factory=list)  # (datums, loss_fn, config, kwargs, output)
    optim: list = dataclasses.field(default_factory=list)  # (AdamParams, gradients)


class _RecordingSampler:
    """A SamplingClient that records what it draws, and how many updates old its weights are when it draws."""

    def __init__(self, sampler, trainer: _RecordingTrainer):
        self._sampler, self._trainer, self._made_at = sampler, trainer, trainer.updates

    def sample_batch(self, prompts, num_samples=1, sampling_params=None):
        responses = self._sampler.sample_batch(prompts, num_samples, sampling_params)
        age = self._trainer.updates - self._made_at
        self._trainer.log.samples.append(([list(_as_ints(p)) for p in prompts], responses, age))
        return responses

    def sample(self, prompt, num_samples=1, sampling_params=None):
        return Future(self.sample_batch([prompt], num_samples, sampling_params)[0])

    async def sample_async(self, prompt, num_samples=1, sampling_params=None):
        return self.sample(prompt, num_samples, sampling_params)

    def __getattr__(self, name):
        return getattr(self._sampler, name)


class _RecordingTrainer:
    """A TrainingClient that records the calls of one step at a time (``begin_step``)."""

    def __init__(self, trainer):
        self._trainer, self.updates, self.log = trainer, 0, _StepLog()

    def begin_step(self) -> _StepLog:
        self.log = _StepLog()
        return self.log

    def save_weights_and_get_sampling_client(self, name="sampler"):
        self.log.samplers_made += 1
        return _RecordingSampler(self._trainer.save_weights_and_get_sampling_client(name), self)

    def forward_backward(self, datums, loss_fn, loss_fn_config=None, **kwargs):
        future = self._trainer.forward_backward(datums, loss_fn, loss_fn_config, **kwargs)
        self.log.forward_backward.append((list(datums), loss_fn, loss_fn_config, kwargs, future.result()))
        return future

    def optim_step(self, adam_params=None):
        params = self._trainer.trainable_parameters()
        if self.log.optim and all(q.grad is None for q in params):
            # A second step on no new gradient: the client would raise "call forward_backward first", a hint one line
            # off. Recorded without running, so that the check names the extra step.
            self.log.optim.append((adam_params, [torch.zeros_like(q) for q in params]))
            lr = (adam_params or AdamParams()).learning_rate
            return Future({"optim/grad_norm": 0.0, "optim/lr": lr})  # the client's keys, for code that reads them
        grads = [q.grad.detach().clone() if q.grad is not None else torch.zeros_like(q) for q in params]
        future = self._trainer.optim_step(adam_params)
        self.log.optim.append((adam_params, grads))
        self.updates += 1
        return future

    async def forward_backward_async(self, datums, loss_fn, loss_fn_config=None, **kwargs):
        return self.forward_backward(datums, loss_fn, loss_fn_config, **kwargs)

    async def optim_step_async(self, adam_params=None):
        return self.optim_step(adam_params)

    def __getattr__(self, name):
        return getattr(self._trainer, name)


def _as_ints(prompt) -> list[int]:
    return prompt.to_ints() if hasattr(prompt, "to_ints") else list(prompt)


def _reference_grpo_step(config, trainer, renderer, task, step):
    """The library's step (:func:`edurl.llm.grpo.grpo_step`) in the exercise's signature."""
    from edurl.llm.grpo import grpo_step

    return grpo_step(config, trainer, renderer, task, step, renderer.get_stop_sequences())[0]


def _step_setup(base=None, config=None):
    """The checked steps' config, two recording trainers on the same weights, the renderer and the task."""
    from edurl.llm.clients import ServiceClient
    from edurl.llm.grpo import GRPOConfig
    from edurl.llm.renderer import ChatMLRenderer
    from edurl.llm.sft import load_or_train_sft

    config = config or GRPOConfig(**STEP_CHECK)
    if base is None:
        model, tokenizer, _, _ = load_or_train_sft(config.sft, progress=False)  # Chapter 6's checkpoint, cached
        base = (model, tokenizer)
    service = ServiceClient(device="cpu")
    trainers = [_RecordingTrainer(service.create_training_client(base, keep_reference=False)) for _ in range(2)]
    return config, trainers, ChatMLRenderer(base[1]), config.sft.task()


def _flat_samples(log: _StepLog) -> list[tuple[list[int], list[int], list[float]]]:
    return [
        (prompt, list(seq.tokens), list(seq.logprobs))
        for prompts, responses, _ in log.samples
        for prompt, response in zip(prompts, responses)
        for seq in response.sequences
    ]


def _datums(log: _StepLog) -> list[Datum]:
    return [d for datums, *_ in log.forward_backward for d in datums]


def _rewards(log: _StepLog, config, renderer, task, step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference step's (P, G) rewards and correctness, recomputed from its samples (grading is deterministic),
    and the rewards a step gets that grades every reply as complete (cut-off ones too)."""
    from edurl.llm.grpo import problem_seed
    from edurl.llm.rewards import grade

    problems = task.sample(config.batch_size, split="train", seed=problem_seed(config.seed, step))
    [(_, responses, _)] = log.samples
    rewards = torch.zeros(config.batch_size, config.group_size)
    correct = torch.zeros(config.batch_size, config.group_size)
    as_complete = torch.zeros(config.batch_size, config.group_size)
    for i, (problem, response) in enumerate(zip(problems, responses)):
        for j, seq in enumerate(response.sequences):
            message, complete = renderer.parse_response(seq.tokens, seq.stop_reason)
            g = grade(message["content"], problem.answer, complete=complete)
            rewards[i, j], correct[i, j] = g.reward, float(g.correct)
            as_complete[i, j] = grade(message["content"], problem.answer).reward
    return rewards, correct, as_complete


def _check_sampling(got: _StepLog, ref: _StepLog, n: int) -> str | None:
    if not got.samples:
        return (
            f"step {n}: nothing was sampled from a sampler made by this trainer in this step. Each step must draw its "
            "completions from trainer.save_weights_and_get_sampling_client(...) called in that step: a sampler kept "
            "from elsewhere samples from old weights (the stale-sampler mistake)."
        )
    stale = max(age for *_, age in got.samples)
    if stale:
        return (
            f"step {n}: the completions came from a sampler made {stale} optimizer step(s) ago (a stale sampler): the "
            "samples are no longer the policy's being trained, so the importance ratio drifts from 1 and the "
            "advantages describe an older policy. Make a fresh sampler at the start of every step."
        )
    got_s, ref_s = _flat_samples(got), _flat_samples(ref)
    if sorted(p for p, _, _ in got_s) != sorted(p for p, _, _ in ref_s):
        return (
            f"step {n}: your prompts are not this step's problems. Sample config.batch_size problems from the train "
            "split with seed problem_seed(config.seed, step), and render each with "
            "renderer.build_generation_prompt(problem.messages())."
        )
    if got_s != ref_s:
        return (
            f"step {n}: the prompts are right but the completions differ from the reference's draw. Sample all the "
            "prompts in one sample_batch call, config.group_size completions each, with SamplingParams that take "
            "max_tokens and temperature from the config, stop from the renderer, and seed=problem_seed(config.seed, "
            "step)."
        )
    return None


def _match(got: list[Datum], ref: list[Datum]) -> list[int] | None:
    """For each learner datum, the index of a reference datum with the same model_input (None if one has none)."""
    free: dict[tuple, list[int]] = {}
    for i, d in enumerate(ref):
        free.setdefault(tuple(d.model_input.to_ints()), []).append(i)
    order = []
    for d in got:
        slots = free.get(tuple(d.model_input.to_ints()))
        if not slots:
            return None
        order.append(slots.pop(0))
    return order


def _field(d: Datum, name: str) -> torch.Tensor:
    return torch.as_tensor(d.loss_fn_inputs[name]).detach().double().cpu()


def _check_layout(got: list[Datum], ref: list[Datum], order: list[int], n: int) -> str | None:
    for k, (d, i) in enumerate(zip(got, order)):
        r = ref[i]
        missing = [f for f in DATUM_FIELDS if f not in d.loss_fn_inputs]
        if missing:
            return f"step {n}, datum {k}: loss_fn_inputs lacks {missing}; build each datum as in exercise 7.2."
        if _field(d, "mask").shape != _field(r, "mask").shape:
            return f"step {n}, datum {k}: its fields are not one value per position of model_input."
        mask, ref_mask = _field(d, "mask"), _field(r, "mask")
        prompt = int((ref_mask == 0).sum())  # len(prompt) - 1 positions predict a prompt token
        if not torch.equal(mask, ref_mask):
            if torch.equal(mask[1:], ref_mask[:-1]) or torch.equal(mask[:-1], ref_mask[1:]):
                return (
                    f"step {n}, datum {k}: off by one. The mask and the sampled log-probs sit one position away from "
                    "the completion's tokens: the first sampled token is predicted at position len(prompt) - 1 (by the "
                    "last prompt token), so the prompt contributes len(prompt) - 1 zeros."
                )
            if mask[:prompt].any():
                return (
                    f"step {n}, datum {k}: the prompt is not masked ({int(mask[:prompt].count_nonzero())} of its "
                    f"{prompt} target positions have mask 1). The policy did not sample the prompt, so those "
                    "positions need mask 0 and advantage 0; otherwise the update also pushes the prompt's tokens."
                )
            return f"step {n}, datum {k}: the mask must be 1 exactly where target_tokens is a sampled token."
        if not torch.equal(_field(d, "target_tokens"), _field(r, "target_tokens")):
            return f"step {n}, datum {k}: target_tokens must be the sequence shifted by one (tokens[1:])."
        if not torch.allclose(_field(d, "logprobs") * mask, _field(r, "logprobs") * ref_mask, atol=1e-6):
            return (
                f"step {n}, datum {k}: the datum's logprobs are not the sampler's log-probs of the completion "
                "(seq.logprobs), which the importance ratio divides by."
            )
    return None


def _advantage_matrix(got: list[Datum], order: list[int], shape) -> torch.Tensor | None:
    """The learner's advantage of each reference completion (P, G); None if one datum's advantage varies by token."""
    out = torch.zeros(shape, dtype=torch.float64)
    for d, i in zip(got, order):
        mask = _field(d, "mask") > 0
        values = _field(d, "advantages")[mask]
        if len(values) and (values - values[0]).abs().max() > 1e-6:
            return None
        out.view(-1)[i] = values[0] if len(values) else 0.0
    return out


def _centred(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x - x.mean(dim=1, keepdim=True)


def _check_advantages(
    got: torch.Tensor | None,
    rewards: torch.Tensor,
    n: int,
    correct: torch.Tensor | None = None,
    as_complete: torch.Tensor | None = None,
) -> str | None:
    rewards = rewards.double()
    expected = _centred(rewards)
    if got is None:
        return (
            f"step {n}: a completion's advantage varies along its tokens. Every sampled token of completion (i, j) "
            "carries the same advantage, A[i, j]."
        )
    if torch.allclose(got, expected, atol=1e-5):
        return None
    if torch.allclose(got, rewards, atol=1e-5):
        return (
            f"step {n}: the advantages are the raw rewards (uncentred): every completion of a group that all got "
            "the same reward still gets pushed, and all of them the same way. Subtract each group's mean reward, "
            "as your group_advantages does."
        )
    cut_off = (
        "replies that max_tokens cut off (no end of turn) were graded as complete: pass parse_response's second "
        "value to grade(..., complete=ok), so that a cut-off reply gets the format term's penalty"
    )
    from_correct = correct is not None and torch.allclose(got, _centred(correct), atol=1e-5)
    from_complete = as_complete is not None and torch.allclose(got, _centred(as_complete), atol=1e-5)
    if from_complete and from_correct:
        return (
            f"step {n}: the advantages follow the correctness (0 or 1), not the reward. Either they come from the "
            f"correctness (use the grade's reward, which also holds the format term), or {cut_off}."
        )
    if from_complete:
        return f"step {n}: the advantages are right except on cut-off replies: {cut_off}."
    if from_correct:
        return (
            f"step {n}: the advantages come from the correctness (0 or 1), not the reward. The reward also "
            "holds the format term (a reply without a boxed answer, or cut off by max_tokens, scores below a "
            "finished one): use the grade's reward."
        )
    if torch.allclose(got, -expected, atol=1e-5):
        return (
            f"step {n}: the sign is flipped: a completion that beat its group's mean got a negative advantage. "
            "A[i, j] = R[i, j] - mean_j R[i, :], reward minus baseline."
        )
    if torch.allclose(got, rewards - rewards.mean(dim=0, keepdim=True), atol=1e-5):
        return (
            f"step {n}: the baseline is the mean over the problems (dim=0), one per completion index; each group's "
            "baseline is the mean of its own G rewards: rewards.mean(dim=1, keepdim=True)."
        )
    sums = got.sum(dim=1)
    r, a = rewards.unsqueeze(2), got.unsqueeze(2)  # (P, G, 1) against (P, 1, G): every pair within a group
    out_of_order = ((r == r.transpose(1, 2)) & ((a - a.transpose(1, 2)).abs() > 1e-5)) | (
        (r > r.transpose(1, 2)) & (a <= a.transpose(1, 2))
    )
    if sums.abs().max() <= 1e-4 and out_of_order.any():
        i = int(out_of_order.flatten(1).any(1).float().argmax())
        return (
            f"step {n}: within problem {i}'s group the advantages do not follow the rewards (rewards "
            f"{[round(x, 3) for x in rewards[i].tolist()]}, advantages {[round(x, 3) for x in got[i].tolist()]}), so "
            "a group mixed completions of different problems. Check that rewards[i, j] is the j-th completion of "
            "problem i (the order of your loops, and the shape you view them in), and that datum (i, j) gets "
            "advantages[i, j]."
        )
    if sums.abs().max() > 1e-4:
        if torch.allclose(got, rewards - rewards.mean(), atol=1e-5):
            return (
                f"step {n}: the baseline is the whole batch's mean reward, not each group's: the completions of one "
                "problem must be compared with each other."
            )
        i = int(sums.abs().argmax())
        return (
            f"step {n}: the advantages of problem {i}'s {rewards.shape[1]} completions sum to {float(sums[i]):+.3f}, "
            "not 0, so a group mixed completions of different problems. Check that rewards[i, j] is the j-th "
            "completion of problem i (the order of your loops, and .view(config.batch_size, config.group_size)), and "
            "that datum (i, j) gets advantages[i, j]."
        )
    return (
        f"step {n}: the advantages differ from rewards minus each group's mean (this config's advantage_scale is "
        "'none': no division by the std)."
    )


def _tensor_list_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.allclose(x, y, rtol=1e-4, atol=1e-7 + 1e-4 * float(y.abs().max()))
        for x, y in zip(a, b)
    )


_FORWARD_BACKWARD_ARGS = (
    ("loss_fn", lambda c: c.loss_fn),
    ("loss_fn_config", lambda c: c.loss_fn_config()),
    ("aggregation", lambda c: c.aggregation),
    ("max_tokens", lambda c: c.max_tokens),
    ("temperature", lambda c: c.temperature),
)


_LEFT_AT_DEFAULT = "its default"


def _wrong_forward_backward_args(calls, config) -> list[tuple[str, object, object]]:
    """Each forward_backward argument that differs from the config's value, once: (name, used, wanted); ``used`` is
    :data:`_LEFT_AT_DEFAULT` for a keyword the call left out."""
    wrong = []
    for name, value in _FORWARD_BACKWARD_ARGS:
        for _, g_fn, g_cfg, g_kwargs, _ in calls:
            used = {"loss_fn": g_fn, "loss_fn_config": g_cfg or {}}.get(name, g_kwargs.get(name, _LEFT_AT_DEFAULT))
            if used != value(config):
                wrong.append((name, used, value(config)))
                break
    return wrong


def _named(wrong: list[tuple[str, object, object]]) -> str:
    return "; ".join(f"{name}={used!r} where the config asks for {wanted!r}" for name, used, wanted in wrong)


def _check_update(got: _StepLog, ref: _StepLog, config, n: int) -> str | None:
    if not got.optim:
        return f"step {n}: the weights never changed. After forward_backward, take one trainer.optim_step(...)."
    if len(got.optim) > 1:
        return (
            f"step {n}: {len(got.optim)} optimizer steps in one step; take exactly one (num_substeps is 1): one "
            "forward_backward on the whole batch, then one optim_step."
        )
    (adam, grads), (ref_adam, ref_grads) = got.optim[0], ref.optim[0]
    calls = got.forward_backward
    wrong = _wrong_forward_backward_args(calls, config)
    if not _tensor_list_close(grads, ref_grads):
        if wrong:
            return (
                f"step {n}: the datums are right but the gradient is not: forward_backward was called with "
                f"{_named(wrong)}. The config names the loss, its loss_fn_config(), the aggregation, the token "
                "budget and the temperature: pass each of them."
            )
        if len(calls) > 1:
            return (
                f"step {n}: the datums are right but the gradient is not: forward_backward ran {len(calls)} times, "
                f"and with aggregation={config.aggregation!r} each call averages over its own tokens. Call it once, "
                "on the whole batch."
            )
        return f"step {n}: the datums are right but the gradient handed to optim_step differs from the reference's."
    # Before the policy moves, importance sampling, PPO, CISPO and DRO give the same gradient up to rounding, so a
    # wrong loss can pass the comparison above; a value passed explicitly against the config's is still named.
    # (An argument left at its default is judged by the gradient alone.)
    explicit = [w for w in wrong if w[1] is not _LEFT_AT_DEFAULT]
    if explicit:
        return (
            f"step {n}: forward_backward was called with {_named(explicit)}. The gradient happens to match on this "
            "step (the policy has not moved yet, and these replies are about equally long); other steps and settings "
            "would differ. Pass the config's values."
        )
    if adam is None or adam.learning_rate != ref_adam.learning_rate:
        lr = "the default" if adam is None else adam.learning_rate
        return (
            f"step {n}: optim_step ran with learning rate {lr}; use AdamParams(learning_rate=config.learning_rate) "
            f"({config.learning_rate})."
        )
    if adam != ref_adam:
        return f"step {n}: optim_step ran with {adam}; use AdamParams(learning_rate=config.learning_rate) only."
    return None


def unloggable(row: dict, n: int) -> str | None:
    """Why the metrics row a learner's step returned cannot be logged (a tensor of many values, a list), as the
    training loop's MetricsLogger would say it in the training cell; None if it can."""
    from edurl.metrics import _to_json_value

    for key, value in row.items():
        try:
            _to_json_value(key, value)
        except (TypeError, ValueError) as err:
            return f"step {n}: the metrics row cannot be logged: {err}"
    return None


def _check_row(row, ref_row, n: int) -> str | None:
    if not isinstance(row, dict):
        extra = " (did you forget the `return` statement?)" if row is None else ""
        return f"step {n}: expected the step's metrics as a dict, got {type(row).__name__}{extra}."
    problem = unloggable(row, n)
    if problem:
        return problem
    for key in ("env/all/correct", "env/all/reward/total"):
        if key not in row:
            return f"step {n}: the metrics row lacks {key!r}, the batch's mean over all P x G completions."
        if abs(float(row[key]) - ref_row[key]) > 1e-6:
            return f"step {n}: row[{key!r}] is {float(row[key]):.4f}; the batch's mean over all P x G completions is {ref_row[key]:.4f}."
    return None


def _step_problem(log, row, ref_log, ref_row, config, renderer, task, step) -> str | None:
    """What is wrong with one of the learner's steps, judged against the reference's records of the same step."""
    n = step + 1
    problem = _check_sampling(log, ref_log, n)
    if problem is None and not log.forward_backward:
        problem = f"step {n}: forward_backward was never called, so no gradient reached the weights."
    if problem is None:
        datums, ref_datums = _datums(log), _datums(ref_log)
        order = _match(datums, ref_datums) if len(datums) == len(ref_datums) else None
        if len(datums) != len(ref_datums):
            problem = (
                f"step {n}: {len(datums)} datums, expected one per completion: config.batch_size x "
                f"config.group_size = {len(ref_datums)}."
            )
        elif order is None or sorted(order) != list(range(len(ref_datums))):
            problem = (
                f"step {n}: a datum's model_input is not a sampled sequence minus its last token "
                "(prompt + completion)[:-1], as in exercise 7.2."
            )
        else:
            rewards, correct, as_complete = _rewards(ref_log, config, renderer, task, step)
            problem = _check_layout(datums, ref_datums, order, n) or _check_advantages(
                _advantage_matrix(datums, order, (config.batch_size, config.group_size)),
                rewards,
                n,
                correct,
                as_complete,
            )
    return problem or _check_update(log, ref_log, config, n) or _check_row(row, ref_row, n)


def _same_weights(trainer, ref_trainer) -> bool:
    return _tensor_list_close(
        [q.detach() for q in trainer.trainable_parameters()], [q.detach() for q in ref_trainer.trainable_parameters()]
    )


def _sync(trainer, ref_trainer) -> None:
    """Give the learner's trainer the reference's weights and Adam state, so float rounding from a different but
    equivalent order of operations (e.g. the datums in another order) cannot change what the next step samples."""
    with torch.no_grad():
        for q, r in zip(trainer.trainable_parameters(), ref_trainer.trainable_parameters()):
            q.copy_(r)
    # a deep copy: load_state_dict keeps the very tensors it is given when their dtype and device already fit
    trainer.optimizer.load_state_dict(copy.deepcopy(ref_trainer.optimizer.state_dict()))


def compare_two_steps(name, fn, reference, trainers, max_steps, run, problem, passed: str) -> Verdict:
    """Run the learner's step ``fn`` beside ``reference`` for ``max_steps`` steps, each on its own recording trainer
    (``trainers`` = (reference's, learner's), on the same weights): ``run(f, trainer, step)`` calls a step, and
    ``problem(log, row, ref_log, ref_row, step)`` names what differs. After each step the learner's trainer gets the
    reference's weights and Adam state back. Chapter 7's and Chapter 10's capstones share it."""
    if not callable(fn):
        return Verdict(name, FAILED, f"expected a function, got {type(fn).__name__}.", reference)
    ref_trainer, trainer = trainers
    for step in range(max_steps):
        ref_log = ref_trainer.begin_step()
        ref_row = run(reference, ref_trainer, step)
        log = trainer.begin_step()
        try:
            row = run(fn, trainer, step)
        except NotImplementedError:
            return Verdict(
                name,
                NOT_ATTEMPTED,
                "Your function still raises NotImplementedError. Fill in the body and run this cell again; until then "
                "the notebook trains with the library's step.",
                reference,
            )
        except Exception as err:  # a learner's bug is reported, never re-raised
            return Verdict(
                name,
                FAILED,
                f"step {step + 1}: your function raised {type(err).__name__}{_where_it_raised(err)}: {err}",
                reference,
            )
        found = problem(log, row, ref_log, ref_row, step)
        if found is None and not _same_weights(trainer, ref_trainer):
            found = (
                f"step {step + 1}: every call matched, but the weights after the step differ from the reference's: "
                "change them only through forward_backward and optim_step."
            )
        if found:
            return Verdict(name, FAILED, found, reference, case=f"step {step + 1}")
        _sync(trainer, ref_trainer)
    return Verdict(name, PASSED, passed, fn)


def _compare_steps(fn, base=None, config=None) -> Verdict:
    config, trainers, renderer, task = _step_setup(base, config)
    return compare_two_steps(
        "Exercise 7.4 grpo_step",
        fn,
        _reference_grpo_step,
        trainers,
        config.max_steps,
        lambda f, trainer, step: f(config, trainer, renderer, task, step),
        lambda log, row, ref_log, ref_row, step: _step_problem(
            log, row, ref_log, ref_row, config, renderer, task, step
        ),
        f"{config.max_steps} steps of {config.batch_size} problems x {config.group_size} completions: fresh samplers, "
        "the same datums, loss and gradients as the library's grpo_step, and the same weights after each update. The "
        "notebook now trains GRPO with your step.",
    )


REFERENCE_TAKES_OVER_STEP = "The notebook trains with the library's grpo_step; fix yours and run this cell again."

_HINTS_GRPO_STEP = Hints(
    idea=(
        "One step is the walk-through of section 1 for a whole batch: sample a group for each of P problems from the "
        "weights as they are now, grade every completion, compare each with its own group, turn each into a masked "
        "datum, then one gradient step on all of them."
    ),
    formula=(
        "sampler = trainer.save_weights_and_get_sampling_client(...); problems = task.sample(P, split='train', "
        "seed=s) with s = problem_seed(config.seed, step); responses = sampler.sample_batch(prompts, G, "
        "SamplingParams(..., seed=s)); rewards (P, G) from grade(); A = group_advantages(rewards); datums = "
        "build_datums(prompt_i, completions_i, A[i]) for each i; forward_backward(datums, config.loss_fn, "
        "config.loss_fn_config(), aggregation=..., max_tokens=..., temperature=...); optim_step(AdamParams("
        "learning_rate=config.learning_rate)); return the mean reward and correctness."
    ),
    solution=_solutions.grpo_step,
)


@with_hints(_HINTS_GRPO_STEP)
def check_grpo_step(fn, *, verbose: bool = True) -> Verdict:
    """Run a learner's ``grpo_step(config, trainer, renderer, task, step) -> dict`` beside the library's for two steps
    from Chapter 6's SFT checkpoint (8 problems x 4 completions) and compare the samplers, the datums, the loss's
    gradients and the updates; the first difference is named from its effect."""
    return finish(_compare_steps(fn), _HINTS_GRPO_STEP, verbose=verbose, on_failure=REFERENCE_TAKES_OVER_STEP)
