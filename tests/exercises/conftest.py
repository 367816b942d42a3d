import inspect
import re

from edurl.exercises._core import FAILED


def _statements(fn) -> list[str]:
    """The worked solution's code lines, whitespace removed, without the def line, docstring and comments."""
    source = inspect.getsource(fn)
    body = re.sub(r'"""(.|\n)*?"""', "", source.split(":\n", 1)[1])
    lines = [re.sub(r"\s+", "", line.split("#")[0]) for line in body.splitlines()]
    return [line for line in lines if len(line) >= 16]


def assert_gives_nothing_away(verdict) -> None:
    """A failure message shows neither hint level 2 (the formula) nor any line of level 3 (the solution's code)."""
    hints = verdict.hints
    assert hints is not None, f"{verdict.exercise} has no hints"
    message = re.sub(r"\s+", "", verdict.message)
    assert re.sub(r"\s+", "", hints.formula) not in message, f"{verdict.exercise}'s message prints the formula"
    for line in _statements(hints.solution):
        assert line not in message, f"{verdict.exercise}'s message prints the solution's line {line!r}"


def assert_rejected(check, buggy, hint: str):
    """``check`` must fail ``buggy``, say ``hint`` in its message and give nothing away; returns the verdict."""
    verdict = check(buggy, verbose=False)
    assert verdict.status == FAILED, f"{getattr(check, '__name__', check)} accepted a buggy implementation"
    assert hint in verdict.message, f"expected {hint!r} in the checker's message, got: {verdict.message}"
    assert_gives_nothing_away(verdict)
    return verdict
