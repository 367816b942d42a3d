import inspect
import re

import pytest

from edurl.exercises._core import FAILED
from edurl.llm.sft import SFTConfig, load_or_train_sft

from ..llm.conftest import SMALL


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


# a small warm start that answers in the right format most of the time, so its groups mix rewards 0 and -0.1
WARM = SFTConfig(model=SMALL, max_steps=300, batch_size=32, warmup_steps=10, num_threads=1, target_pass_at_1=None)


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    import os

    old = os.environ.get("EDURL_CACHE")
    os.environ["EDURL_CACHE"] = str(tmp_path_factory.mktemp("edurl-cache"))
    try:
        model, tokenizer, _, _ = load_or_train_sft(WARM, progress=False)
    finally:
        if old is None:
            del os.environ["EDURL_CACHE"]
        else:
            os.environ["EDURL_CACHE"] = old
    return model, tokenizer
