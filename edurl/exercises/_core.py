"""The machinery behind every exercise checker.

A checker calls the learner's function on a list of :class:`Case` inputs, compares each result with
the reference implementation, and returns a :class:`Verdict`:

- ``"passed"``: every case matched. ``verdict.implementation`` is the learner's function.
- ``"failed"``: the first failing case is shown (inputs, expected, got) with a hint.
  ``verdict.implementation`` is the reference, so the rest of the notebook still runs.
- ``"not attempted"``: the stub still raises ``NotImplementedError``. The notebook carries on
  with the reference.

Help comes in three levels that the learner asks for, never unasked: ``verdict.hint(1)`` the idea,
``verdict.hint(2)`` the formula, ``verdict.hint(3)`` the code of the worked solution. A failure message
names the mistake when it recognises it, and shows the smallest failing case, but never the formula or the code.

A learner's exception is caught and reported in one line with the line of their code that raised
it; it never surfaces as a bare traceback.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import sys
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

PASSED, FAILED, NOT_ATTEMPTED = "passed", "failed", "not attempted"


class Printed(str):
    """Text that was printed already: a notebook does not show it again as the cell's result (``verdict.hint(1)``
    on its own once showed the hint twice, the second time as a quoted string full of ``\\n``). It is a ``str``
    in every other way."""

    def _ipython_display_(self) -> None:
        pass


def printed(text: str) -> Printed:
    """Print ``text`` and return it as :class:`Printed`."""
    print(text)
    return Printed(text)


_ICONS = {PASSED: "✅", FAILED: "❌", NOT_ATTEMPTED: "⏳"}
_ASCII_ICONS = {PASSED: "[ok]", FAILED: "[x]", NOT_ATTEMPTED: "[..]"}


def _icons() -> dict[str, str]:
    """The verdict's icons, or ASCII markers where ``sys.stdout`` cannot encode them: on Windows a redirected
    stdout or an IDE console is cp1252 (without PYTHONUTF8=1), and printing an emoji there raises
    UnicodeEncodeError. Asked at each print, as stdout can be replaced after import."""
    encoding = getattr(sys.stdout, "encoding", None)
    if not encoding:  # a stream without one (Jupyter's, some wrappers) takes str, written as UTF-8
        return _ICONS
    try:
        "".join(_ICONS.values()).encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return _ASCII_ICONS
    return _ICONS


class CheckFailure(Exception):
    """Raised by a checker's wrapper around the learner's function to report a problem in plain words."""


@dataclass
class Case:
    """One input to check: a short name a learner can read, and the keyword arguments."""

    name: str
    kwargs: dict[str, Any]


@dataclass
class Diagnosis:
    """A known mistake: if the learner's output matches ``buggy(**kwargs)``, show ``hint``."""

    buggy: Callable[..., Any]
    hint: str


@dataclass(frozen=True)
class Hints:
    """Three levels of help for one exercise, from least to most given away."""

    idea: str
    """Level 1: what the function must do and why, in words, with no formula."""
    formula: str
    """Level 2: the formula or the steps, in maths or pseudo-code."""
    solution: Callable[..., Any]
    """Level 3: the worked solution (in ``edurl/exercises/solutions/``), whose source is shown."""

    def level(self, n: int) -> str:
        if n not in (1, 2, 3):
            raise ValueError(f"hint levels are 1 (the idea), 2 (the formula) and 3 (the code), got {n!r}.")
        if n == 1:
            return f"Hint 1 of 3 (the idea): {self.idea}"
        if n == 2:
            return f"Hint 2 of 3 (the formula): {self.formula}"
        return "Hint 3 of 3 (the code of the worked solution):\n" + inspect.getsource(self.solution)


ASK_FOR_HINTS = (
    "Stuck? Ask for help one level at a time: verdict.hint(1) the idea, hint(2) the formula, hint(3) the code."
)


REFERENCE_TAKES_OVER = "The notebook continues with the reference update; fix yours and run this cell again."


def finish(verdict: Verdict, hints: Hints, *, verbose: bool, on_failure: str = "") -> Verdict:
    """Attach an exercise's hints to its verdict; on a failure add ``on_failure`` and how to ask for hints; print
    it if ``verbose``. Returns a new verdict."""
    message = verdict.message
    if verdict.status == FAILED:
        message += "".join(f"\n  {line}" for line in (on_failure, ASK_FOR_HINTS) if line)
    verdict = dataclasses.replace(verdict, message=message, hints=hints)
    if verbose:
        print(verdict)
    return verdict


@dataclass
class Verdict:
    """The result of a check. ``print(verdict)`` gives the readable report."""

    exercise: str
    status: str
    message: str
    implementation: Callable[..., Any]
    """The function to use from here on: the learner's if it passed, else the reference."""
    case: str | None = None
    """Name of the first failing case, if any."""
    details: dict[str, str] = field(default_factory=dict)
    hints: Hints | None = None
    """The exercise's three levels of help; ``hint(n)`` prints level n."""

    def hint(self, level: int = 1) -> str:
        """Print (and return) hint ``level``: 1 the idea, 2 the formula, 3 the code of the worked solution. A notebook
        shows it once: the returned text does not show again as the cell's result (:class:`Printed`)."""
        if self.hints is None:
            raise ValueError(f"{self.exercise} has no hints.")
        return printed(self.hints.level(level))

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        icon = _icons()[self.status]
        return f"{icon} {self.exercise}: {self.status}. {self.message}"


def format_value(x: Any) -> str:
    """Short, readable text for a tensor, array or scalar."""
    if isinstance(x, torch.Tensor):
        body = np.array2string(
            x.detach().cpu().numpy(), precision=4, suppress_small=True, threshold=60, max_line_width=100
        )
        return f"tensor(shape={tuple(x.shape)}, dtype={str(x.dtype).replace('torch.', '')})\n{body}"
    if isinstance(x, float):
        return f"{x:.6g}"
    if isinstance(x, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in x):
        return "\n".join(f"[{i}] {format_value(v)}" for i, v in enumerate(x))
    return repr(x)


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def _installed(filename: str) -> bool:
    """Whether ``filename`` belongs to an installed package or the standard library, not to the learner."""
    path = Path(filename).resolve()
    if "site-packages" in path.parts or "dist-packages" in path.parts:
        return True
    return any(path.is_relative_to(Path(sysconfig.get_paths()[key]).resolve()) for key in ("stdlib", "platstdlib"))


def _where_it_raised(err: BaseException) -> str:
    """The learner's own line: the last frame of the traceback outside the edurl package and outside installed
    packages and the standard library (a learner's call to ``F.mse_loss`` with mismatched shapes raises inside
    torch; a learner's code that calls into the library, e.g. a client, raises from the library's frames: the line
    shown is still theirs). If every such frame is in a package, the last frame outside edurl."""
    package = str(Path(__file__).resolve().parents[1])
    frames = [
        f for f in traceback.extract_tb(err.__traceback__) if not str(Path(f.filename).resolve()).startswith(package)
    ]
    if not frames:
        return ""
    # "<string>": code that Python generated, such as a dataclass's __init__, has no line of the learner's
    f = next((f for f in reversed(frames) if f.filename != "<string>" and not _installed(f.filename)), frames[-1])
    code = (f.line or "").strip()
    return f" (at line {f.lineno}: `{code}`)" if code else f" (at line {f.lineno})"


def _clone(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in kwargs.items()}


def _same(a: Any, b: Any) -> bool:
    """Exact equality that also looks inside tensors, arrays and dataclasses (such as a TabularMDP)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a is b or a == b


def compare_tensors(got: Any, expected: torch.Tensor, *, rtol: float = 1e-5, atol: float = 1e-6) -> str | None:
    """Return None if ``got`` matches ``expected`` (type, shape, dtype, device, values), else what is wrong."""
    if not isinstance(got, torch.Tensor):
        extra = " (a tuple: return just the tensor)" if isinstance(got, tuple) else ""
        if isinstance(got, np.ndarray):
            extra = " (a NumPy array: build the result with torch operations, or torch.as_tensor(...) it)"
        if got is None:
            extra = " (did you forget the `return` statement?)"
        return f"expected a torch.Tensor, got {type(got).__name__}{extra}."
    if got.shape != expected.shape:
        return f"expected shape {tuple(expected.shape)}, got {tuple(got.shape)}."
    if got.dtype != expected.dtype:
        hint = ""
        if got.dtype == torch.get_default_dtype() and expected.dtype.is_floating_point:
            hint = (
                " torch.zeros(T, N), torch.empty(...) and torch.tensor(a_list) make the default dtype; build the "
                "result with torch.zeros_like(input), or end with .to(input.dtype)."
            )
        elif got.is_floating_point() and expected.dtype.is_floating_point:
            hint = " Compute in any precision you like, and end with .to(input.dtype)."
        return f"expected dtype {expected.dtype} (the same as the input), got {got.dtype}.{hint}"
    if got.device != expected.device:
        return f"expected the result on {expected.device}, got it on {got.device}."
    bad = torch.isnan(got) & ~torch.isnan(expected)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.dim() else ()
        return f"got NaN at index {idx} where {expected[idx].item():.6g} was expected (a division by zero?)."
    if not torch.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=True):
        diff = (got - expected).abs()
        idx = tuple(int(i) for i in np.unravel_index(int(diff.argmax()), tuple(diff.shape))) if diff.dim() else ()
        return (
            f"values differ: largest error {diff.max().item():.4g} at index {idx} "
            f"(expected {expected[idx].item():.6g}, got {got[idx].item():.6g})."
        )
    return None


def compare_outputs(names: Sequence[str], **tolerances) -> Callable[[Any, Any], str | None]:
    """A ``compare`` for functions that return a tuple of tensors, naming the element that is wrong. A list of the
    same length is accepted too: every caller unpacks the result (``advantages, returns = gae(...)``)."""

    def compare(got: Any, expected: tuple) -> str | None:
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            return f"expected a tuple of {len(expected)} tensors ({', '.join(names)}), got {type(got).__name__}" + (
                f" of length {len(got)}." if isinstance(got, (tuple, list)) else "."
            )
        for name, g, e in zip(names, got, expected):
            problem = compare_tensors(g, e, **tolerances)
            if problem:
                return f"{name}: {problem}"
        return None

    return compare


def run_checker(
    exercise: str,
    fn: Callable[..., Any],
    reference: Callable[..., Any],
    cases: Sequence[Case],
    *,
    diagnoses: Sequence[Diagnosis] = (),
    hints: Hints | None = None,
    compare: Callable[[Any, Any], str | None] = compare_tensors,
    wrap: Callable[[Callable], Callable] | None = None,
    verbose: bool = True,
) -> Verdict:
    """Check ``fn`` against ``reference`` on every case and return (and, if verbose, print) the verdict.

    ``wrap``, if given, turns a function into what is actually compared (for example its loss *and*
    its gradients); it is applied alike to the learner's function, the reference and the diagnoses.
    The verdict's ``implementation`` is always the unwrapped function.
    """
    verdict = _check(exercise, fn, reference, cases, diagnoses, compare, wrap or (lambda f: f))
    verdict = dataclasses.replace(verdict, hints=hints)
    if verbose:
        print(verdict)
    return verdict


def _check(exercise, fn, reference, cases, diagnoses, compare, wrap) -> Verdict:
    def fail(case: Case, problem: str, got: Any = None, expected: Any = None, hint: str = "") -> Verdict:
        parts = [f"Case '{case.name}': {problem}"]
        details = {"inputs": "\n".join(f"{k} = {format_value(v)}" for k, v in case.kwargs.items())}
        parts.append("  inputs:\n" + _indent(details["inputs"]))
        if expected is not None:
            details["expected"], details["got"] = format_value(expected), format_value(got)
            parts.append("  expected:\n" + _indent(details["expected"]))
            parts.append("  got:\n" + _indent(details["got"]))
        if hint:
            parts.append(f"  the likely mistake: {hint}")
        parts.append("  The notebook continues with the reference implementation; fix yours and run this cell again.")
        parts.append("  " + ASK_FOR_HINTS)
        return Verdict(exercise, FAILED, "\n".join(parts), reference, case.name, details)

    if not callable(fn):
        return Verdict(
            exercise,
            FAILED,
            f"expected a function, got {type(fn).__name__}. Pass the function itself "
            f"(check(my_fn)), not the result of calling it (check(my_fn(...))).",
            reference,
        )

    for i, case in enumerate(cases):
        kwargs = _clone(case.kwargs)
        expected = wrap(reference)(*_clone(case.kwargs).values())
        try:
            got = wrap(fn)(*kwargs.values())  # positional, so a learner may rename the parameters
        except NotImplementedError as err:
            if i == 0:
                return Verdict(
                    exercise,
                    NOT_ATTEMPTED,
                    "Your function still raises NotImplementedError. Fill in the body and run this cell "
                    "again; until then the notebook uses the reference implementation.",
                    reference,
                )
            return fail(case, f"raised NotImplementedError{_where_it_raised(err)}: {err}")
        except CheckFailure as err:
            return fail(case, str(err))
        except Exception as err:  # a learner's bug is reported, never re-raised
            return fail(case, f"your function raised {type(err).__name__}{_where_it_raised(err)}: {err}")
        for name, value in kwargs.items():
            if not _same(value, case.kwargs[name]):
                return fail(
                    case,
                    f"your function changed its input `{name}` in place. Work on a copy "
                    "(or build a new tensor) so the caller's data stays intact.",
                )
        problem = compare(got, expected)
        if problem is None:
            continue
        hint = ""
        for diagnosis in diagnoses:
            try:
                if compare(got, wrap(diagnosis.buggy)(*_clone(case.kwargs).values())) is None:
                    hint = diagnosis.hint
                    break
            except Exception:
                continue
        return fail(case, problem, got, expected, hint)

    return Verdict(
        exercise, PASSED, f"All {len(cases)} cases match the reference. The notebook now uses your implementation.", fn
    )


def with_hints(hints: Hints) -> Callable[[Callable], Callable]:
    """Attach an exercise's :class:`Hints` to its checker, so ``exercises.hint(name, level)`` finds them."""

    def attach(checker: Callable) -> Callable:
        checker.hints = hints
        return checker

    return attach
