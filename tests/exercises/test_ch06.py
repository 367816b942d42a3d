import pytest
import torch

from edurl import exercises
from edurl.exercises import NOT_ATTEMPTED, PASSED
from edurl.exercises.ch06 import (
    _full_sequence_input,
    _targets_not_shifted,
    datum_shifted_by_prompt_length,
    datum_with_unmasked_prompt,
)
from edurl.exercises.solutions.ch06 import build_datum
from edurl.llm.datum import Datum, ModelInput
from edurl.llm.datum import build_datum as reference

from .conftest import assert_rejected


def test_reference_and_worked_solution_pass():
    assert exercises.check_build_datum(reference, verbose=False).status == PASSED
    assert exercises.check_build_datum(build_datum, verbose=False).status == PASSED


def _no_mask_field(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
    d = reference(prompt_tokens, completion_tokens, sampling_logprobs, advantage)
    return Datum(d.model_input, {k: v for k, v in d.loss_fn_inputs.items() if k != "mask"})


def _mask_only_advantages(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
    # masks the advantages but leaves mask = 1 on the prompt: token-mean losses would count the prompt
    d = reference(prompt_tokens, completion_tokens, sampling_logprobs, advantage)
    return Datum(d.model_input, {**d.loss_fn_inputs, "mask": torch.ones(d.model_input.length)})


def _numpy_datum(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
    """Correct, with NumPy's ints as the ids (rejected by ModelInput.from_ints before)."""
    import numpy as np

    tokens = np.asarray([*prompt_tokens, *completion_tokens])
    n, k = len(prompt_tokens), len(completion_tokens)
    logprobs = np.concatenate([np.zeros(n - 1), np.asarray(sampling_logprobs, dtype=np.float32)])
    mask = np.concatenate([np.zeros(n - 1), np.ones(k)])
    fields = dict(target_tokens=tokens[1:], logprobs=logprobs, advantages=mask * advantage, mask=mask)
    return Datum(ModelInput.from_ints(list(tokens[:-1])), {k: torch.as_tensor(v) for k, v in fields.items()})


def test_numpy_ids_pass():
    verdict = exercises.check_build_datum(_numpy_datum, verbose=False)
    assert verdict.status == PASSED, verdict.message


def test_a_list_for_model_input_is_named_at_the_learners_line():
    def list_as_input(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
        tokens = list(prompt_tokens) + list(completion_tokens)
        fields = {"target_tokens": torch.tensor(tokens[1:])}
        return Datum(model_input=tokens[:-1], loss_fn_inputs=fields)  # no ModelInput.from_ints

    verdict = assert_rejected(
        exercises.check_build_datum, list_as_input, "build it from the token ids with ModelInput.from_ints"
    )
    assert "(at line" in verdict.message and "no ModelInput.from_ints" in verdict.message  # not <string>'s line


def _float_targets(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
    # not ids: .long() once truncated 11.4 to 11, and this passed
    d = reference(prompt_tokens, completion_tokens, sampling_logprobs, advantage)
    return Datum(d.model_input, {**d.loss_fn_inputs, "target_tokens": d.loss_fn_inputs["target_tokens"] + 0.4})


def test_whole_float_ids_pass_and_other_floats_are_named():
    def whole_floats(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
        d = reference(prompt_tokens, completion_tokens, sampling_logprobs, advantage)
        return Datum(d.model_input, {**d.loss_fn_inputs, "target_tokens": d.loss_fn_inputs["target_tokens"].float()})

    assert exercises.check_build_datum(whole_floats, verbose=False).status == PASSED
    assert_rejected(exercises.check_build_datum, _float_targets, "target_tokens must be token ids, whole numbers")


@pytest.mark.parametrize(
    "buggy, message",
    [
        (datum_shifted_by_prompt_length, "off by one"),
        (datum_with_unmasked_prompt, "the prompt is not masked"),
        (_targets_not_shifted, "target_tokens must be the input shifted left by one"),
        (_full_sequence_input, "model_input is tokens[:-1]"),
        (_no_mask_field, "loss_fn_inputs lacks ['mask']"),
        (_mask_only_advantages, "mask: values differ"),
    ],
)
def test_buggy_versions_are_rejected_with_the_right_hint(buggy, message):
    verdict = assert_rejected(exercises.check_build_datum, buggy, message)
    assert verdict.implementation is reference


def test_stub_and_wrong_types():
    def stub(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
        raise NotImplementedError

    assert exercises.check_build_datum(stub, verbose=False).status == NOT_ATTEMPTED

    def returns_dict(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
        return {"model_input": prompt_tokens}

    assert "expected a Datum, got dict" in exercises.check_build_datum(returns_dict, verbose=False).message

    def model_input_too_long(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
        tokens = list(prompt_tokens) + list(completion_tokens)
        return Datum(ModelInput.from_ints(tokens), {"target_tokens": torch.tensor(tokens[1:])})

    assert_rejected(exercises.check_build_datum, model_input_too_long, "has shape")


def test_solution_is_registered(capsys):
    assert "len(prompt_tokens) - 1" in exercises.show_solution("build_datum")
