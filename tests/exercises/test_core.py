"""The checker machinery: verdicts for every way a learner's function can go wrong, never a bare traceback."""

import io
import sys

import numpy as np
import pytest
import torch

from edurl.exercises._core import FAILED, NOT_ATTEMPTED, PASSED, Case, Diagnosis, compare_tensors, run_checker


def double(x):
    return 2 * x


CASES = [Case("small", {"x": torch.tensor([1.0, 2.0])}), Case("bigger", {"x": torch.arange(6.0)})]


def check(fn, **kw):
    return run_checker("double", fn, double, CASES, verbose=False, **kw)


def test_pass_uses_learner_function():
    mine = lambda x: x + x  # noqa: E731
    verdict = check(mine)
    assert verdict.status == PASSED and verdict.implementation is mine and verdict


def test_not_attempted_only_on_first_case():
    def stub(x):
        raise NotImplementedError

    assert check(stub).status == NOT_ATTEMPTED

    def half_done(x):
        if len(x) > 2:
            raise NotImplementedError("big inputs")
        return 2 * x

    verdict = check(half_done)
    assert verdict.status == FAILED and verdict.case == "bigger" and "big inputs" in verdict.message


def test_exception_is_reported_with_the_learners_line():
    def broken(x):
        return x.nonexistent_method()

    verdict = check(broken)
    assert verdict.status == FAILED
    assert "raised AttributeError" in verdict.message and "x.nonexistent_method()" in verdict.message
    assert verdict.implementation is double


def test_an_error_raised_inside_torch_or_the_standard_library_names_the_learners_line():
    """A shape mismatch raises deep inside torch: the message once quoted torch's own line
    (`_VF.broadcast_tensors(...)`) instead of the learner's call; the same for the standard library's json."""
    import json

    def broadcast(x):
        return torch.broadcast_tensors(x, torch.zeros(3))

    def parse(x):
        return json.loads("not json") * x

    for fn, line in ((broadcast, "torch.broadcast_tensors(x, torch.zeros(3))"), (parse, 'json.loads("not json")')):
        verdict = check(fn)
        assert verdict.status == FAILED and f"`return {line}" in verdict.message, verdict.message


def test_wrong_type_shape_dtype_and_none():
    assert "got ndarray" in check(lambda x: (2 * x).numpy()).message
    assert "forget the `return`" in check(lambda x: None).message
    assert "a tuple" in check(lambda x: (2 * x, 0)).message
    assert "expected shape (2,), got (1, 2)" in check(lambda x: (2 * x)[None]).message
    assert "expected dtype torch.float32" in check(lambda x: (2 * x).double()).message


def test_values_report_the_largest_error():
    verdict = check(lambda x: 2 * x + (x == 2).float())
    assert "largest error 1 at index (1,) (expected 4, got 5)" in verdict.message
    assert verdict.details["expected"].startswith("tensor(shape=(2,)")


def test_in_place_mutation_is_caught():
    def mutate(x):
        x.mul_(2)
        return x

    assert "changed its input `x` in place" in check(mutate).message


def test_diagnosis_hint_is_shown_when_output_matches_a_known_bug():
    verdict = check(lambda x: 3 * x, diagnoses=[Diagnosis(lambda x: 3 * x, "you tripled it")])
    assert "the likely mistake: you tripled it" in verdict.message
    verdict = check(lambda x: 4 * x, diagnoses=[Diagnosis(lambda x: 3 * x, "you tripled it")])
    assert "likely mistake" not in verdict.message and "verdict.hint(1)" in verdict.message


def test_not_callable():
    verdict = check(torch.tensor([2.0, 4.0]))
    assert verdict.status == FAILED and "Pass the function itself" in verdict.message


def test_printed_verdict(capsys):
    run_checker("double", double, double, CASES)
    assert capsys.readouterr().out.startswith("✅ double: passed")


@pytest.mark.parametrize(
    "encoding, marks",
    [("cp1252", ["[ok]", "[x]", "[..]"]), ("utf-8", ["✅", "❌", "⏳"]), (None, ["✅", "❌", "⏳"])],
)
def test_printed_verdict_falls_back_to_ascii_where_stdout_cannot_encode_the_icons(monkeypatch, encoding, marks):
    # a Windows console or redirected stdout in cp1252 raised UnicodeEncodeError at print(verdict); None: a
    # stream without an encoding, as Jupyter's may be, takes the icons
    out = io.TextIOWrapper(io.BytesIO(), encoding=encoding) if encoding else io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)

    def stub(x):
        raise NotImplementedError

    for fn in (double, lambda x: 3 * x, stub):
        run_checker("double", fn, double, CASES)
    out.flush()
    text = out.buffer.getvalue().decode(encoding) if encoding else out.getvalue()
    for mark, status in zip(marks, (PASSED, FAILED, NOT_ATTEMPTED)):
        assert f"{mark} double: {status}." in text


def test_compare_tensors_nan_equal_and_none():
    nan = torch.tensor([np.nan, 1.0])
    assert compare_tensors(nan.clone(), nan) is None
    assert compare_tensors(torch.tensor([1.0]), torch.tensor([1.0])) is None


def test_hints_come_in_three_levels_and_only_when_asked(capsys):
    import pytest

    from edurl.exercises._core import Hints

    hints = Hints(idea="twice as much", formula="y = 2 * x", solution=double)
    verdict = check(lambda x: 3 * x, hints=hints)
    assert "twice as much" not in verdict.message and "y = 2 * x" not in verdict.message
    assert "verdict.hint(1)" in verdict.message
    assert verdict.hint(1) == "Hint 1 of 3 (the idea): twice as much"
    assert verdict.hint(2) == "Hint 2 of 3 (the formula): y = 2 * x"
    assert "return 2 * x" in verdict.hint(3) and "return 2 * x" in capsys.readouterr().out
    # printed once: a notebook does not show the returned text again as the cell's result (it showed it twice)
    from IPython.core.formatters import DisplayFormatter

    from edurl import exercises

    assert DisplayFormatter().format(verdict.hint(1)) == ({}, {})
    assert DisplayFormatter().format(exercises.show_solution("bellman_backup")) == ({}, {})
    with pytest.raises(ValueError, match="hint levels are 1"):
        verdict.hint(4)


def test_the_leak_detector_catches_a_message_that_prints_the_solution():
    import pytest

    from edurl.exercises._core import Hints
    from tests.exercises.conftest import assert_gives_nothing_away

    def solution(x):
        doubled_values = x * 2.0 + 0.0
        return doubled_values

    hints = Hints(idea="twice", formula="y = 2x", solution=solution)
    leaky = check(
        lambda x: 3 * x, hints=hints, diagnoses=[Diagnosis(lambda x: 3 * x, "write doubled_values = x * 2.0 + 0.0")]
    )
    with pytest.raises(AssertionError, match="prints the solution's line"):
        assert_gives_nothing_away(leaky)
    formula = check(lambda x: 3 * x, hints=hints, diagnoses=[Diagnosis(lambda x: 3 * x, "y = 2x")])
    with pytest.raises(AssertionError, match="prints the formula"):
        assert_gives_nothing_away(formula)
    assert_gives_nothing_away(check(lambda x: 3 * x, hints=hints))


def test_every_exercise_has_three_levels_of_help():
    from edurl import exercises

    for name, (_, checker, solution) in exercises.EXERCISES.items():
        assert checker.hints.solution is solution, name
        assert len(checker.hints.idea) > 40 and checker.hints.formula, name
        assert exercises.hint(name, 3).endswith(exercises.show_solution(name)), name


def test_compare_outputs_takes_a_list_as_well_as_a_tuple():
    """gae returned as [advantages, returns] was once "expected a tuple" though every caller unpacks it."""
    from edurl.exercises._core import compare_outputs

    compare = compare_outputs(["a", "b"])
    expected = (torch.tensor([1.0]), torch.tensor([2.0]))
    assert compare(list(expected), expected) is None
    assert "b: values differ" in compare([expected[0], expected[0]], expected)
    assert "got list of length 3" in compare([*expected, expected[0]], expected)
    assert "got Tensor." in compare(expected[0], expected)


def test_every_solution_named_in_a_solutions_docstring_is_registered():
    """The solutions of Chapter 9 once named show_solution("reverse_word_env"), a KeyError: its name is "env"."""
    import importlib
    import re

    from edurl import exercises

    for chapter in range(1, 11):
        module = importlib.import_module(f"edurl.exercises.solutions.ch{chapter:02d}")
        for name in re.findall(r'"(\w+)"', module.__doc__):
            assert name in exercises.EXERCISES, f"{module.__name__}'s docstring names {name!r}, not an exercise"


def test_refuse_overwrite_sees_new_values_and_a_new_shape_but_not_nan_where_nan_was():
    from edurl.exercises._core import CheckFailure
    from edurl.exercises._grad import refuse_overwrite

    original = torch.tensor([[1.0, float("nan"), 3.0]])
    given = original.clone().requires_grad_(True)
    refuse_overwrite("x", given, original)  # untouched, NaN included
    given.data = given.data[0]  # (3,) against (1, 3): broadcasting would call it equal
    with pytest.raises(CheckFailure, match="changed its input `x` in place"):
        refuse_overwrite("x", given, original)
    given = original.clone().requires_grad_(True)
    given.detach()[0, 0] = 2.0
    with pytest.raises(CheckFailure, match="changed its input `x`"):
        refuse_overwrite("x", given, original)
