"""docs/glossary.md names one code name per concept: each must exist, and each metric must be logged."""

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "glossary.md"


def table_rows():
    rows = []
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 6 and cells[0] not in ("concept",) and not set(cells[0]) <= {"-"}:
            rows.append(cells)
    return rows


def code_names():
    return sorted({name for row in table_rows() for name in re.findall(r"`(edurl\.[\w.]+(?:\(\w+\))?)`", row[2])})


def metric_names():
    return sorted({name for row in table_rows() for name in re.findall(r"`([\w/]+/[\w/]+)`", row[3])})


def resolve(path: str):
    """``edurl.a.b.C.field``, ``edurl.a.f(param)`` or ``edurl.a.attr``: raise if it does not exist."""
    m = re.fullmatch(r"([\w.]+?)(?:\((\w+)\))?", path)
    dotted, param = m.group(1), m.group(2)
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError:
            continue
    for attr in parts[i:]:
        if (
            dataclasses.is_dataclass(obj)
            and isinstance(obj, type)
            and attr in {f.name for f in dataclasses.fields(obj)}
        ):
            obj = dataclasses.fields(obj)  # a field: nothing below it to resolve
            continue
        obj = getattr(obj, attr)
    if param is not None:
        assert param in inspect.signature(obj).parameters, f"{dotted} has no parameter {param!r}"


def test_the_glossary_has_rows():
    assert len(table_rows()) >= 30 and len(code_names()) >= 50 and len(metric_names()) >= 10


@pytest.mark.parametrize("name", code_names())
def test_every_code_name_exists(name):
    resolve(name)


def test_resolve_rejects_names_that_do_not_exist():
    for bad in (
        "edurl.llm.grpo.GRPOConfig.lr",
        "edurl.llm.losses.rl_objective(logprobs)",
        "edurl.rl.ppo.norm_adv",
        "edurl.llm.losses.clip_range",
    ):
        with pytest.raises((AttributeError, AssertionError)):
            resolve(bad)


@pytest.mark.parametrize("metric", metric_names())
def test_every_metric_is_logged_by_the_library(metric):
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "edurl").rglob("*.py"))
    # Chapter 5's PPO logs its update columns with an "optim/" prefix: f"optim/{k}"
    name = metric.removeprefix("optim/")
    assert f'"{metric}"' in source or (metric.startswith("optim/") and f'"{name}"' in source), metric


def test_old_names_are_gone_from_the_code():
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "edurl").rglob("*.py"))
    for old in (
        "old_logprobs",
        "norm_adv",
        "def clip_range(",
        "clip_range=",
        "value_lr",
        "config.threads()",
        "def _run(",
    ):
        assert old not in source, old
