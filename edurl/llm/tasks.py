"""Synthetic problems with verifiable answers (Chapter 6).

``ArithmeticTask`` generates multi-digit addition and subtraction problems from
a seed. Every problem belongs to exactly one split, decided by a hash of the
problem itself, so train and test are disjoint by construction no matter how
many problems are drawn. ``JsonlTask`` reads a learner's own
``{"question": ..., "answer": ...}`` lines instead.

Answers are written as ``\\boxed{N}``, the final-answer convention of math RL
datasets; :mod:`edurl.llm.rewards` grades it. With ``styled=True`` (Chapter 8) each demonstration also
has a manner drawn at random: an opening from :data:`OPENINGS` and 0 to 3 trailing :data:`FILLER`\\ s, so
a policy warm-started on them writes replies that differ in ways a reward model can see.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from edurl._checks import is_whole
from edurl.llm.rewards import is_integer_answer

SPLITS = ("train", "valid", "test")
OPENINGS = ("", "The answer is ", "Sure! ")
"""The openings of styled demonstrations (Chapter 8), drawn uniformly."""
FILLER = " ok"
"""The padding that styled demonstrations may end with."""
FILLER_COUNTS = (0, 0, 1, 2, 3)
"""How many fillers a styled demonstration ends with, drawn uniformly from this tuple (mean 1.2)."""


def split_by_hash(text: str, test_fraction: float, valid_fraction: float) -> str:
    """The split of the problem written ``text``, from a fixed hash (the same on every machine and run)."""
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2**64  # in [0, 1)
    if h < test_fraction:
        return "test"
    return "valid" if h < test_fraction + valid_fraction else "train"


def check_fractions(test_fraction: float, valid_fraction: float) -> None:
    if not (0.0 < test_fraction < 1.0 and 0.0 <= valid_fraction < 1.0 and test_fraction + valid_fraction < 1.0):
        raise ValueError(
            f"test_fraction ({test_fraction}) must be in (0, 1) and valid_fraction ({valid_fraction}) "
            "in [0, 1), leaving some problems for train"
        )


@dataclass(frozen=True)
class Problem:
    """One question and its reference answer (a string, compared after stripping)."""

    question: str
    answer: str

    def messages(self) -> list[dict[str, str]]:
        """The chat messages a policy sees: a single user turn."""
        return [{"role": "user", "content": self.question}]

    def demonstration(self) -> str:
        """The target assistant reply used for supervised fine-tuning."""
        return format_answer(self.answer)


@dataclass(frozen=True)
class StyledProblem(Problem):
    """A problem whose demonstration has a manner (Chapter 8): ``opening + \\boxed{answer} + FILLER * fillers``."""

    opening: str = ""
    fillers: int = 0

    def demonstration(self) -> str:
        return self.opening + format_answer(self.answer) + FILLER * self.fillers


def style(problems: list[Problem], seed: int, split: str) -> list[StyledProblem]:
    """The same problems with an opening and a filler count each, drawn from their own seeded stream (so a
    styled task asks exactly the questions of the plain one)."""
    rng = random.Random(f"style-{seed}-{split}")
    return [StyledProblem(p.question, p.answer, rng.choice(OPENINGS), rng.choice(FILLER_COUNTS)) for p in problems]


def format_answer(answer: object) -> str:
    """``42`` -> ``\\boxed{42}``."""
    return "\\boxed{" + str(answer) + "}"


def _check_n(n) -> int:
    """A number of problems to sample: a whole number >= 0 (a NumPy int too, not a bool), as an int."""
    if not is_whole(n) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}: the number of problems to sample")
    return int(n)


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


@dataclass
class TaskConfig:
    """The task that the SFT warm start learns and GRPO then trains on: one definition for both.

    ``SFTConfig`` is a ``TaskConfig`` (these fields come first in it, so on the command line they are
    ``--sft.num-digits`` and ``--sft.ops``), and a GRPO run's task is its warm start's: ``GRPOConfig.sft``.
    """

    num_digits: int = 2
    """Task difficulty: operands have up to this many digits (1 to 9)."""
    ops: tuple[str, ...] = ("+",)
    """Operations in the task: any of "+" and "-"."""
    styled: bool = False
    """Demonstrations with a random opening and trailing fillers (Chapter 8's warm start); False: bare answers."""

    def __post_init__(self) -> None:
        self.ops = tuple(self.ops)
        self.task()  # ArithmeticTask checks num_digits and ops, with the messages its callers also see

    def task(self) -> ArithmeticTask:
        """The task these fields describe."""
        return ArithmeticTask(num_digits=self.num_digits, ops=self.ops, styled=self.styled)


class ArithmeticTask:
    """Addition and subtraction of numbers with up to ``num_digits`` digits.

    Args:
        num_digits: the difficulty knob; operands are drawn uniformly from
            ``[0, 10**num_digits)``.
        ops: any of ``"+"`` and ``"-"``.
        allow_negative: if False (default), subtraction puts the larger operand
            first so answers are never negative.
        test_fraction, valid_fraction: the shares of all possible problems in the test and
            validation splits; the rest is train.
        styled: if True, problems are :class:`StyledProblem` s whose demonstrations vary in manner
            (see :func:`style`); the questions and answers are those of the plain task.
    """

    def __init__(
        self,
        num_digits: int = 2,
        ops: tuple[str, ...] = ("+", "-"),
        allow_negative: bool = False,
        test_fraction: float = 0.1,
        valid_fraction: float = 0.05,
        styled: bool = False,
    ):
        if not isinstance(num_digits, int) or not 1 <= num_digits <= 9:
            raise ValueError(f"num_digits must be an int in [1, 9], got {num_digits!r}")
        ops = tuple(ops)
        if not ops or any(op not in ("+", "-") for op in ops):
            raise ValueError(f"ops must be a non-empty tuple of '+' and '-', got {ops!r}")
        check_fractions(test_fraction, valid_fraction)
        self.num_digits = num_digits
        self.ops = ops
        self.allow_negative = allow_negative
        self.test_fraction = test_fraction
        self.valid_fraction = valid_fraction
        self.styled = bool(styled)

    def __repr__(self) -> str:
        styled = ", styled=True" if self.styled else ""
        return (
            f"ArithmeticTask(num_digits={self.num_digits}, ops={self.ops}, allow_negative={self.allow_negative}"
            f"{styled})"
        )

    def split_of(self, a: int, op: str, b: int) -> str:
        """Which split the problem ``a op b`` belongs to (a fixed hash, not Python's ``hash``)."""
        return split_by_hash(f"{a}{op}{b}", self.test_fraction, self.valid_fraction)

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        hi = 10**self.num_digits
        a, b = rng.randrange(hi), rng.randrange(hi)
        op = rng.choice(self.ops)
        if op == "-" and not self.allow_negative and b > a:
            a, b = b, a
        return a, op, b

    def sample(self, n: int, split: str = "train", seed: int = 0) -> list[Problem]:
        """``n`` problems from ``split``, reproducible from ``seed`` (repeats possible)."""
        _check_split(split)
        n = _check_n(n)  # 2.5 gave 3 problems, True 1, None a TypeError from the comparison
        rng = random.Random(f"{seed}-{split}")
        out: list[Problem] = []
        draws = 0
        while len(out) < n:
            a, op, b = self._draw(rng)
            draws += 1
            if self.split_of(a, op, b) == split:
                out.append(make_problem(a, op, b))
            elif not out and draws == 100_000:  # it once drew forever from an empty split (valid_fraction=0)
                raise ValueError(
                    f"no problem of the {split!r} split in 100,000 draws: with num_digits={self.num_digits}, "
                    f"test_fraction={self.test_fraction} and valid_fraction={self.valid_fraction} it is empty or "
                    "nearly so. Raise that split's fraction, or num_digits."
                )
        return style(out, seed, split) if self.styled else out


def make_problem(a: int, op: str, b: int) -> Problem:
    """The problem ``a op b`` in the course's wording."""
    value = a + b if op == "+" else a - b
    return Problem(question=f"{a}{op}{b}=?", answer=str(value))


class JsonlTask:
    """Problems from a local JSONL file, one ``{"question": ..., "answer": ...}`` per line.

    The file has no split of its own, so a problem's split is decided by a hash of
    its question, like ``ArithmeticTask``'s. Not by the same hash: ``ArithmeticTask`` hashes
    ``"12+34"`` and this class the whole question (``"12+34=?"``), so an ``ArithmeticTask``'s
    problems written to a file land in other splits here (its test problems mostly in train).
    """

    def __init__(self, path: str | Path, test_fraction: float = 0.1, valid_fraction: float = 0.05):
        check_fractions(test_fraction, valid_fraction)
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"JSONL task file {str(path)!r} does not exist")
        self.path = path
        self.test_fraction = test_fraction
        self.problems: dict[str, list[Problem]] = {s: [] for s in SPLITS}
        # split on "\n" only: str.splitlines() also splits at U+2028 and U+0085, which JSON strings may hold as they
        # are (json.dumps(..., ensure_ascii=False) writes them), and a valid file was refused
        for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problem = Problem(question=str(row["question"]), answer=str(row["answer"]).strip())
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object with 'question' and 'answer', got {line[:80]!r} ({err})"
                ) from None
            if not is_integer_answer(problem.answer):
                raise ValueError(
                    f"{path}:{lineno}: answer {problem.answer!r} is not an integer; edurl.llm.grade marks "
                    "a reply correct only for an optional sign followed by ASCII digits, so write "
                    'integer answers (e.g. "answer": 46), or grade this task with your own reward.'
                )
            self.problems[split_by_hash(problem.question, test_fraction, valid_fraction)].append(problem)
        if not any(self.problems.values()):
            raise ValueError(f"{path} holds no problems")

    def sample(self, n: int, split: str = "train", seed: int = 0) -> list[Problem]:
        """``n`` problems drawn with replacement from ``split``."""
        n = _check_n(n)  # -3 once returned [], as 0 does
        pool = self.problems[_check_split(split)]
        if not pool:
            raise ValueError(f"{self.path} has no problems in the {split!r} split")
        rng = random.Random(f"{seed}-{split}")
        return [rng.choice(pool) for _ in range(n)]
