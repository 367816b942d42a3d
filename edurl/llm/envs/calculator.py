"""A calculator tool: the model may ask it before answering (Chapter 9).

The task is 3-digit addition, which the course's tiny model gets wrong more often than not in its head. On
any turn the model may write a tool call, ``<calc>123+456</calc>``; the environment evaluates the expression
with :func:`calculate`, a small parser for integers, ``+ - *`` and parentheses (never Python's ``eval``), and
answers with a ``tool`` message: the value, or ``error: ...`` saying what was wrong. A reply with a
``\\boxed{}`` answer ends the episode and is graded as in Chapter 7 (``correct + 0.1 * (format - 1)``).

With ``tool_enabled=False`` every call is answered ``error: no calculator``, which measures what the same
model does without the tool.
"""

from __future__ import annotations

import re

from edurl.llm.envs.base import MessageEnv, ProblemGroupBuilder
from edurl.llm.renderer import ChatMLRenderer, Message
from edurl.llm.rewards import extract_boxed, grade

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
OPEN = "<calc>"
MAX_EXPRESSION = 64
"""Longest expression the calculator reads, in characters."""
MAX_DIGITS = 30
"""Largest result, in digits: a product of long numbers is refused rather than computed."""


class ToolError(ValueError):
    """A malformed expression; its message is what the model reads."""


def calculate(expression: str) -> int:
    """The value of ``expression``: integers combined with ``+``, ``-``, ``*`` and parentheses, spaces allowed.

    Raises :class:`ToolError` (a ``ValueError``) with a short reason for anything else. It never calls ``eval``
    and never raises another exception type, whatever the string."""
    if not isinstance(expression, str):
        raise ToolError("the expression must be text")
    if len(expression) > MAX_EXPRESSION:
        raise ToolError(f"expression longer than {MAX_EXPRESSION} characters")
    tokens = re.findall(r"\d+|[-+*()]|\S", expression)
    for tok in tokens:
        if not (tok.isascii() and tok.isdigit()) and tok not in "+-*()":
            raise ToolError(f"unexpected character {tok!r}")
    if not tokens:
        raise ToolError("empty expression")
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def check(value: int) -> int:
        if len(str(abs(value))) > MAX_DIGITS:
            raise ToolError(f"result longer than {MAX_DIGITS} digits")
        return value

    def atom(depth: int) -> int:
        if depth > 10:
            raise ToolError("expression nested too deep (parentheses or signs)")
        tok = peek()
        if tok is None:
            raise ToolError("expression ends too early")
        if tok == "-":
            take()
            return -atom(depth + 1)
        if tok == "(":
            take()
            value = expr(depth + 1)
            if peek() != ")":
                raise ToolError("missing ')'")
            take()
            return value
        if tok.isdigit():
            take()
            if len(tok) > MAX_DIGITS:
                raise ToolError(f"number longer than {MAX_DIGITS} digits")
            return int(tok)
        raise ToolError(f"expected a number, got {tok!r}")

    def term(depth: int) -> int:
        value = atom(depth)
        while peek() == "*":
            take()
            value = check(value * atom(depth))
        return value

    def expr(depth: int) -> int:
        value = term(depth)
        while peek() in ("+", "-"):
            op = take()
            value = check(value + term(depth) if op == "+" else value - term(depth))
        return value

    value = expr(0)
    if pos != len(tokens):
        raise ToolError(f"unexpected {tokens[pos]!r}")
    return value


def run_tool(text: str) -> str:
    """The tool message for a reply that contains ``<calc>``: the first call's value, or ``error: ...``."""
    match = CALL.search(text)
    if match is None:
        return "error: write <calc>expression</calc>"
    try:
        return str(calculate(match.group(1)))
    except ToolError as err:
        return f"error: {err}"


class CalculatorEnv(MessageEnv):
    """One arithmetic problem, with a calculator the model may call up to ``max_tool_calls`` times."""

    def __init__(
        self,
        question: str,
        answer: str,
        renderer: ChatMLRenderer,
        tool_enabled: bool = True,
        max_tool_calls: int = 2,
        tool_cost: float = 0.0,
    ):
        super().__init__(renderer)
        if not isinstance(max_tool_calls, int) or max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be an int >= 0, got {max_tool_calls!r}")
        if not 0 <= tool_cost < 1:
            raise ValueError(f"tool_cost must be in [0, 1), got {tool_cost!r}")
        self.question, self.answer = question, answer
        self.tool_enabled, self.max_tool_calls, self.tool_cost = tool_enabled, max_tool_calls, tool_cost
        self.tool_calls = self.tool_errors = 0
        self.max_turns = max_tool_calls + 1

    def initial_messages(self) -> list[Message]:
        self.tool_calls = self.tool_errors = 0
        return [{"role": "user", "content": self.question}]

    def truncated_metrics(self) -> dict[str, float]:
        return self._end("")[3]

    def truncated(self, text: str) -> tuple[float, dict[str, float]]:
        """Graded as Chapter 7 grades a cut-off reply (format 0, so -0.1 unless its box is right), less the tool's
        cost: it once scored 0, above every finished wrong answer, so running out of tokens paid."""
        reward, _, _, metrics = self._end(text, complete=False)
        return reward, metrics

    def _end(self, text: str, complete: bool = True) -> tuple[float, bool, list[Message], dict[str, float]]:
        g = grade(text, self.answer, complete=complete)
        reward = g.reward - self.tool_cost * self.tool_calls
        metrics = {
            "correct": g.correct,
            "format": g.format,
            "tool_calls": float(self.tool_calls),
            "used_tool": float(self.tool_calls > 0),
            "tool_errors": float(self.tool_errors),
        }
        return reward, True, [], metrics

    def reply(self, text: str) -> tuple[float, bool, list[Message], dict[str, float]]:
        if extract_boxed(text) is not None or OPEN not in text or self.tool_calls >= self.max_tool_calls:
            return self._end(text)
        self.tool_calls += 1
        result = run_tool(text) if self.tool_enabled else "error: no calculator"
        self.tool_errors += result.startswith("error")
        return 0.0, False, [{"role": "tool", "content": result}], {"tool_calls": float(self.tool_calls)}


class CalculatorGroupBuilder(ProblemGroupBuilder):
    """``group_size`` episodes of one problem (a :class:`edurl.llm.Problem`)."""

    def __init__(self, problem, renderer: ChatMLRenderer, group_size: int, **env_kwargs):
        super().__init__(
            lambda: CalculatorEnv(problem.question, problem.answer, renderer, **env_kwargs),
            group_size,
            tags=["calculator"],
        )
        self.problem = problem


def tool_demonstration(problem) -> list[Message]:
    """The problem solved with the calculator: call, result, answer."""
    a_op_b = problem.question.removesuffix("=?")
    return [
        {"role": "user", "content": problem.question},
        {"role": "assistant", "content": f"<calc>{a_op_b}</calc>"},
        {"role": "tool", "content": str(calculate(a_op_b))},
        {"role": "assistant", "content": f"\\boxed{{{problem.answer}}}"},
    ]


def direct_demonstration(problem) -> list[Message]:
    """The problem answered in one turn, without the tool."""
    return [
        {"role": "user", "content": problem.question},
        {"role": "assistant", "content": f"\\boxed{{{problem.answer}}}"},
    ]
