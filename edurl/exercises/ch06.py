"""Checker for Chapter 6's exercise: build a training datum from a prompt and a sampled completion (6.1)."""

from __future__ import annotations

import torch

from edurl.exercises._core import (
    Case,
    CheckFailure,
    Diagnosis,
    Hints,
    Verdict,
    compare_outputs,
    run_checker,
    with_hints,
)
from edurl.exercises.solutions import ch06 as _solutions
from edurl.llm.datum import DATUM_FIELDS, Datum, ModelInput
from edurl.llm.datum import build_datum as _reference

__all__ = ["check_build_datum", "datum_shifted_by_prompt_length", "datum_with_unmasked_prompt"]

_NAMES = ("model_input", *DATUM_FIELDS)


def _as_tuple(fn):
    """Run ``fn`` and lay its Datum out as (model_input, target_tokens, logprobs, advantages, mask) tensors."""

    def run(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
        datum = fn(prompt_tokens, completion_tokens, sampling_logprobs, advantage)
        if not isinstance(datum, Datum):
            raise CheckFailure(
                f"expected a Datum, got {type(datum).__name__}. Return "
                "Datum(model_input=ModelInput.from_ints(...), loss_fn_inputs={...})."
            )
        missing = [k for k in DATUM_FIELDS if k not in datum.loss_fn_inputs]
        if missing:
            raise CheckFailure(f"loss_fn_inputs lacks {missing}; it needs {list(DATUM_FIELDS)}.")
        fields = [torch.as_tensor(datum.loss_fn_inputs[k]) for k in DATUM_FIELDS]
        targets = fields[0]
        if targets.is_floating_point() and not (targets == targets.round()).all():
            at = int((targets != targets.round()).nonzero()[0, 0])
            raise CheckFailure(
                f"target_tokens must be token ids, whole numbers, got {targets[at].item():g} at index {at}. They are "
                "the next tokens of the sequence (tokens[1:]), not log-probs or advantages; build them with "
                "torch.tensor(ids, dtype=torch.long)."
            )
        return (
            torch.tensor(datum.model_input.to_ints(), dtype=torch.long),
            fields[0].long(),
            *(f.float() for f in fields[1:]),
        )

    return run


def datum_shifted_by_prompt_length(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
    """A realistic bug in ``build_datum``, public because Chapter 7's checker reuses it per completion."""
    # the classic off-by-one: len(prompt) zeros instead of len(prompt) - 1, and the last action dropped
    d = _reference(prompt_tokens, completion_tokens, sampling_logprobs, advantage)
    f = d.loss_fn_inputs
    shifted = {k: torch.cat([torch.zeros(1, dtype=v.dtype), v[:-1]]) for k, v in f.items() if k != "target_tokens"}
    return Datum(d.model_input, {"target_tokens": f["target_tokens"], **shifted})


def _targets_not_shifted(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
    d = _reference(prompt_tokens, completion_tokens, sampling_logprobs, advantage)
    return Datum(d.model_input, {**d.loss_fn_inputs, "target_tokens": torch.tensor(d.model_input.to_ints())})


def datum_with_unmasked_prompt(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
    """A realistic bug in ``build_datum`` (the prompt gets the advantage), also reused by Chapter 7's checker."""
    d = _reference(prompt_tokens, completion_tokens, sampling_logprobs, advantage)
    f = d.loss_fn_inputs
    return Datum(
        d.model_input,
        {**f, "advantages": torch.full_like(f["advantages"], float(advantage)), "mask": torch.ones_like(f["mask"])},
    )


def _full_sequence_input(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
    tokens = list(prompt_tokens) + list(completion_tokens)
    n = len(prompt_tokens)
    return Datum(
        ModelInput.from_ints(tokens),
        {
            "target_tokens": torch.tensor(tokens[1:] + [0]),
            "logprobs": torch.tensor([0.0] * n + list(sampling_logprobs)),
            "advantages": torch.tensor([0.0] * n + [float(advantage)] * len(completion_tokens)),
            "mask": torch.tensor([0.0] * n + [1.0] * len(completion_tokens)),
        },
    )


_DIAGNOSES = [
    Diagnosis(
        datum_shifted_by_prompt_length,
        "off by one: the first sampled token is predicted at position "
        "len(prompt) - 1 (from the last prompt token), so the prompt contributes "
        "len(prompt) - 1 zeros, not len(prompt).",
    ),
    Diagnosis(
        datum_with_unmasked_prompt,
        "the prompt is not masked: prompt tokens were not sampled by the policy, so "
        "their advantage and mask must be 0.",
    ),
    Diagnosis(
        _targets_not_shifted,
        "target_tokens must be the input shifted left by one: tokens[1:], while model_input is tokens[:-1].",
    ),
    Diagnosis(_full_sequence_input, "model_input is tokens[:-1]: the last token is only ever a target."),
]


def _cases() -> list[Case]:
    g = torch.Generator().manual_seed(6)
    cases = [
        Case(
            "3-token prompt, 2-token completion",
            dict(
                prompt_tokens=[10, 11, 12], completion_tokens=[20, 21], sampling_logprobs=[-0.5, -0.25], advantage=2.0
            ),
        ),
        Case(
            "1-token prompt",
            dict(prompt_tokens=[7], completion_tokens=[8, 9, 3], sampling_logprobs=[-1.0, -2.0, -0.1], advantage=-0.5),
        ),
        Case(
            "1-token completion",
            dict(prompt_tokens=[3, 1, 4, 1], completion_tokens=[5], sampling_logprobs=[-0.7], advantage=0.375),
        ),
    ]
    for n_prompt, n_completion in [(25, 11), (40, 3)]:
        cases.append(
            Case(
                f"random {n_prompt}-token prompt, {n_completion}-token completion",
                dict(
                    prompt_tokens=torch.randint(5, 100, (n_prompt,), generator=g).tolist(),
                    completion_tokens=torch.randint(5, 100, (n_completion,), generator=g).tolist(),
                    sampling_logprobs=(-torch.rand(n_completion, generator=g) * 3).tolist(),
                    advantage=float(torch.randn(1, generator=g)),
                ),
            )
        )
    return cases


_HINTS_BUILD_DATUM = Hints(
    idea=(
        "The model reads every token but the last and predicts every token but the first. Only the "
        "predictions of completion tokens are actions: they carry the sampled log-probs, the advantage and "
        "mask 1. The predictions of prompt tokens carry zeros."
    ),
    formula="tokens = prompt + completion; model_input = tokens[:-1]; target_tokens = "
    "tokens[1:]; logprobs, advantages and mask are 0 on the len(prompt) - 1 "
    "prompt targets, then the sampled log-probs, A, and 1.",
    solution=_solutions.build_datum,
)


@with_hints(_HINTS_BUILD_DATUM)
def check_build_datum(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``build_datum(prompt_tokens, completion_tokens, sampling_logprobs, advantage)``."""
    return run_checker(
        "Exercise 6.1 build_datum",
        fn,
        _reference,
        _cases(),
        diagnoses=_DIAGNOSES,
        compare=compare_outputs(_NAMES, rtol=1e-6, atol=1e-6),
        wrap=_as_tuple,
        verbose=verbose,
        hints=_HINTS_BUILD_DATUM,
    )
