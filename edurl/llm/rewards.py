"""Verifiable rewards for boxed answers (Chapter 6).

The reward follows the Tinker Cookbook's ``math_rl`` convention::

    reward = correct + 0.1 * (format - 1)

so a correct, well-formed answer scores 1, a well-formed wrong answer 0, and a
reply with no parseable ``\\boxed{...}`` -0.1. A reply cut off before its stop token
has format 0: -0.1 if wrong, 0.9 if its box is right. ``correct`` and ``format`` are reported separately because they fail for
different reasons: format is learned in a few steps, correctness is the task.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FORMAT_COEF = 0.1
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


@dataclass(frozen=True)
class Grade:
    """The outcome of grading one reply: ``reward`` and its two parts (each 0.0 or 1.0)."""

    reward: float
    correct: float
    format: float


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, stripped, or None if there is none."""
    found = _BOXED.findall(text)
    return found[-1].strip() if found else None


_INTEGER = re.compile(r"[+-]?[0-9]+")  # ASCII digits only: [0-9], not \d, which matches any Unicode digit


def is_integer_answer(text: str) -> bool:
    """True for an optional sign followed by ASCII digits: the only answers :func:`grade` can mark correct."""
    return _INTEGER.fullmatch(text) is not None


def _same_answer(given: str, answer: str) -> bool:
    """True when both are integers written as an optional sign and ASCII digits, and equal: "007" and "7",
    "+7" and "7" agree; "4_6", "٤٦" (Arabic-Indic digits) or "4 6" are not answers, though Python's int()
    reads the first two as 46."""
    if not (_INTEGER.fullmatch(given) and _INTEGER.fullmatch(answer)):
        return False
    return canonical_integer(given) == canonical_integer(answer)


def canonical_integer(text: str) -> str:
    """An integer written as an optional sign and ASCII digits, in one spelling: no "+", no leading zeros, and "0"
    for minus zero ("-007" gives "-7"). Compared as text, so a reply of thousands of digits (a model repeating one)
    is graded, where int() refuses strings of more than 4300 digits."""
    digits = text.lstrip("+-").lstrip("0") or "0"
    return "-" + digits if text.startswith("-") and digits != "0" else digits


def grade(response: str, answer: str, complete: bool = True) -> Grade:
    """Grade a reply against the reference ``answer``. Never raises on any string.

    ``complete`` is False when the reply ended without its stop token (it ran out
    of tokens); such a reply has format 0 even if it holds a box.
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    given = extract_boxed(response)
    fmt = float(given is not None and given != "" and complete)
    correct = float(given is not None and _same_answer(given, str(answer).strip()))
    return Grade(reward=correct + FORMAT_COEF * (fmt - 1.0), correct=correct, format=fmt)
