import copy

import pytest

from edurl import exercises
from edurl.exercises import FAILED, NOT_ATTEMPTED, PASSED
from edurl.exercises.ch05 import reference_clip_table
from edurl.exercises.solutions.ch05 import clip_table

from .conftest import assert_rejected


def test_reference_table_from_autograd_matches_the_worked_solution():
    assert reference_clip_table() == clip_table()


def test_correct_table_passes():
    assert exercises.check_clip_table(clip_table(), verbose=False).status == PASSED
    # capitals and spaces are the same answer: a right 'Clipped' was once told that min() takes the other term
    shouted = {key: {**row, "min picks": f" {row['min picks'].title()} "} for key, row in clip_table().items()}
    assert exercises.check_clip_table(shouted, verbose=False).status == PASSED


def test_a_table_computed_with_autograd_passes():
    """'gradient is zero' as autograd gives it, a bool tensor (r.grad == 0) or numpy's bool, was once rejected with
    'write True or False'; 0 and 1 are still refused (the exercise asks for True or False)."""
    import numpy as np
    import torch

    for as_computed in (torch.tensor, np.bool_, lambda b: np.array([b])):
        table = {
            key: {**row, "gradient is zero": as_computed(row["gradient is zero"])} for key, row in clip_table().items()
        }
        verdict = exercises.check_clip_table(table, verbose=False)
        assert verdict.status == PASSED, verdict.message
    assert_rejected(exercises.check_clip_table, _with({(("A > 0", "inside"), "gradient is zero"): 0}), "write True")
    several = _with({(("A > 0", "inside"), "gradient is zero"): torch.tensor([False, False])})
    assert_rejected(exercises.check_clip_table, several, "write True or False")


def test_the_min_hint_is_given_only_where_a_term_was_mixed_up():
    """'min() takes the smaller value, also when both are negative' answered the inside row, where the terms are
    equal and the mistake is not writing 'both'."""
    verdict = assert_rejected(
        exercises.check_clip_table, _with({(("A > 0", "inside"), "min picks"): "unclipped"}), "write 'both'"
    )
    assert "also when both are negative" not in verdict.message
    verdict = assert_rejected(
        exercises.check_clip_table, _with({(("A < 0", "r < 1 - eps"), "min picks"): "unclipped"}), "the other one"
    )
    assert "also when both are negative" in verdict.message


def _with(changes):
    table = copy.deepcopy(clip_table())
    for (key, field), value in changes.items():
        table[key][field] = value
    return table


@pytest.mark.parametrize(
    "table, message",
    [
        # the classic confusion: for A < 0 thinking the clip binds above 1 + eps, as for A > 0
        (
            _with(
                {
                    (("A < 0", "r < 1 - eps"), "min picks"): "unclipped",
                    (("A < 0", "r > 1 + eps"), "min picks"): "clipped",
                }
            ),
            "row ('A < 0', 'r < 1 - eps'): min picks",
        ),
        # believing the gradient vanishes whenever the ratio is outside the range
        (_with({(("A > 0", "r < 1 - eps"), "gradient is zero"): True}), "autograd says the gradient is not zero"),
        # believing the clipped term is used inside the range, with zero gradient
        (_with({(("A > 0", "inside"), "min picks"): "clipped"}), "min picks 'clipped'"),
        # inside the range the two terms are equal: "clipped" was once told that min() takes "the other one"
        (_with({(("A < 0", "inside"), "min picks"): "unclipped"}), "are equal, so min() takes either: write 'both'"),
        (_with({(("A > 0", "r > 1 + eps"), "min picks"): "both"}), "are not equal, so 'both' is not right"),
        # a word for the gradient was once told "autograd says the gradient is zero there"
        (_with({(("A > 0", "r > 1 + eps"), "gradient is zero"): "yes"}), "'gradient is zero' is 'yes'; write True"),
    ],
)
def test_wrong_tables_are_rejected(table, message):
    assert_rejected(exercises.check_clip_table, table, message)


def test_unfilled_and_malformed():
    blank = {key: {"min picks": None, "gradient is zero": None} for key in clip_table()}
    assert exercises.check_clip_table(blank, verbose=False).status == NOT_ATTEMPTED
    assert exercises.check_clip_table([], verbose=False).status == FAILED
    partial = copy.deepcopy(clip_table())
    partial[("A > 0", "inside")] = {"picks": "both"}
    assert "expected a dict with keys" in exercises.check_clip_table(partial, verbose=False).message
    # rows as tuples were once "not attempted"; a half-filled table named None as the learner's pick
    tuples = {key: (row["min picks"], row["gradient is zero"]) for key, row in clip_table().items()}
    assert "expected a dict with keys" in exercises.check_clip_table(tuples, verbose=False).message
    half = copy.deepcopy(clip_table())
    half[("A < 0", "inside")] = {"min picks": None, "gradient is zero": None}
    assert "is not filled in yet" in exercises.check_clip_table(half, verbose=False).message
    typo = copy.deepcopy(clip_table())
    typo[("A < 0", "inside")]["min picks"] = "unclippd"
    assert "write one of" in exercises.check_clip_table(typo, verbose=False).message
