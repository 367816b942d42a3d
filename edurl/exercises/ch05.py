"""Checker for Chapter 5's exercise: the clip-case table (5.1), verified against autograd."""

from __future__ import annotations

import dataclasses

from edurl.exercises._core import ASK_FOR_HINTS, FAILED, NOT_ATTEMPTED, PASSED, Hints, Verdict, with_hints
from edurl.exercises.solutions import ch05 as _solutions
from edurl.rl.clip_explorer import clip_case

__all__ = ["check_clip_table", "CLIP_TABLE_CASES", "reference_clip_table"]

CLIP_EPS = 0.2
#: (advantage sign, ratio region) -> a ratio inside that region, used to ask autograd
CLIP_TABLE_CASES = {
    ("A > 0", "r < 1 - eps"): (1.0, 0.5),
    ("A > 0", "inside"): (1.0, 1.05),
    ("A > 0", "r > 1 + eps"): (1.0, 1.5),
    ("A < 0", "r < 1 - eps"): (-1.0, 0.5),
    ("A < 0", "inside"): (-1.0, 1.05),
    ("A < 0", "r > 1 + eps"): (-1.0, 1.5),
}


def reference_clip_table() -> dict:
    """The table computed from the training code's loss with autograd."""
    table = {}
    for key, (adv, ratio) in CLIP_TABLE_CASES.items():
        picks, zero = clip_case(ratio, adv, CLIP_EPS)
        table[key] = {"min picks": picks, "gradient is zero": zero}
    return table


_HINTS_CLIP_TABLE = Hints(
    idea=(
        "In each row, work out both terms of the min at the row's ratio and advantage, see which one is smaller, "
        "and ask whether that term still changes when r changes."
    ),
    formula=(
        "L(r) = min(r * A, clip(r, 1 - eps, 1 + eps) * A); min() takes the smaller value (also when both are "
        "negative), and d/dr clip(r) = 0 outside [1 - eps, 1 + eps]."
    ),
    solution=_solutions.clip_table,
)


@with_hints(_HINTS_CLIP_TABLE)
def check_clip_table(table, *, verbose: bool = True) -> Verdict:
    """Check a learner's clip-case table: for each (sign of A, ratio region), which term min() picks
    ("unclipped", "clipped", or "both" when they are equal) and whether the gradient is zero."""
    reference = reference_clip_table()
    verdict = _check(table, reference)
    if verdict.status == FAILED:
        verdict = dataclasses.replace(verdict, message=verdict.message + "\n  " + ASK_FOR_HINTS)
    verdict = dataclasses.replace(verdict, hints=_HINTS_CLIP_TABLE)
    if verbose:
        print(verdict)
    return verdict


def _check(table, reference) -> Verdict:
    name = "Exercise 5.1 clip table"
    if not isinstance(table, dict):
        return Verdict(name, FAILED, f"expected a dict keyed by (sign, region), got {type(table).__name__}.", reference)
    cells = [table.get(key) for key in reference]
    if all(c is None or all(v is None for v in c.values()) for c in cells if isinstance(c, dict) or c is None):
        return Verdict(name, NOT_ATTEMPTED, "Fill in the table (replace each None) and run this cell again.", reference)
    for key, expected in reference.items():
        got = table.get(key)
        if not isinstance(got, dict) or set(got) != set(expected):
            return Verdict(
                name,
                FAILED,
                f"row {key}: expected a dict with keys {sorted(expected)}, got {got!r}.",
                reference,
                case=str(key),
            )
        adv, ratio = CLIP_TABLE_CASES[key]
        if got["min picks"] != expected["min picks"]:
            return Verdict(
                name,
                FAILED,
                f"row {key}: min picks {got['min picks']!r}, but at A = {adv:+.0f}, r = {ratio}, eps = "
                f"{CLIP_EPS}: r*A = {ratio * adv:.2f} and clip(r)*A = "
                f"{min(max(ratio, 1 - CLIP_EPS), 1 + CLIP_EPS) * adv:.2f}, so min() takes the other one. "
                "Hint: min() takes the *smaller* (more pessimistic) value, also when both are negative.",
                reference,
                case=str(key),
            )
        if got["gradient is zero"] != expected["gradient is zero"]:
            return Verdict(
                name,
                FAILED,
                f"row {key}: autograd says the gradient is {'zero' if expected['gradient is zero'] else 'not zero'}"
                f" there. Hint: the gradient is zero exactly when min() picks the clipped term, "
                "because clip(r) is constant outside [1 - eps, 1 + eps].",
                reference,
                case=str(key),
            )
    return Verdict(name, PASSED, "All six cells agree with autograd.", table)
