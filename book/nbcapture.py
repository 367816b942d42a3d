"""A pytest plugin that keeps what nbval's execution of each notebook printed and drew.

`make test` runs every notebook once under nbval. This plugin copies each cell's outputs into the notebook
and, when every cell of a notebook has passed, writes it to _build/executed/NN_slug.ipynb with a stamp of
what it was run from (the notebook's bytes and the edurl sources). `make book` (book/build.py) renders those
copies, so the book shows outputs without executing the notebooks a second time; a copy whose stamp no
longer matches is executed again, by the same nbval command.

Loaded from the repository's conftest.py; it does nothing for items that are not nbval cells, except that with
``$EDURL_FAILURES_DIR`` set it writes every failing test's report to that folder as it happens (``gpu_check.py``
sets it, so a run cut short by its time limit still says what failed and what the cell printed).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
# The course's notebooks and where their executed copies go (the environment variables exist for the tests).
NOTEBOOKS_DIR = Path(os.environ.get("EDURL_BOOK_NOTEBOOKS", ROOT / "notebooks"))
EXECUTED_DIR = Path(os.environ.get("EDURL_BOOK_EXECUTED", ROOT / "_build" / "executed"))
STAMP_KEY = "edurl_execution"
#: When set, each failing test's report is written at once to a file in this folder (see record_failure).
FAILURES_ENV = "EDURL_FAILURES_DIR"


def source_stamp(notebook: Path) -> dict:
    """What an executed copy of `notebook` depends on: the notebook's bytes and every edurl source file."""
    lib = hashlib.sha256()
    for path in sorted((ROOT / "edurl").rglob("*.py")):
        lib.update(str(path.relative_to(ROOT)).encode())
        lib.update(path.read_bytes())
    return {
        "notebook_sha256": hashlib.sha256(Path(notebook).read_bytes()).hexdigest(),
        "edurl_sha256": lib.hexdigest(),
    }


def executed_copy(notebook: Path) -> Path:
    return EXECUTED_DIR / Path(notebook).name


def is_fresh(notebook: Path) -> bool:
    """Whether _build/executed holds a passing execution of this exact notebook and library."""
    copy = executed_copy(notebook)
    if not copy.exists():
        return False
    try:
        stamp = json.loads(copy.read_text(encoding="utf-8"))["metadata"].get(STAMP_KEY, {})
    except (ValueError, KeyError):
        return False
    return stamp == source_stamp(notebook)


def _is_nbval_cell(item) -> bool:
    return type(item).__name__ == "IPyNbCell" and hasattr(item, "cell") and hasattr(item.parent, "nb")


def _printed(outputs) -> str:
    """What a cell printed or showed as text: its streams, its errors' tracebacks and its text/plain results."""
    parts = []
    for out in outputs:
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") == "error":
            parts.append("\n".join(out.get("traceback", [])))
        elif "text/plain" in out.get("data", {}):
            parts.append(out["data"]["text/plain"])
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts)


def record_failure(item, report, directory: Path) -> Path:
    """Write what is known of a failed test to ``directory`` at once: its id, and for a notebook cell its source and
    what it printed; then what the test captured and the failure. A run stopped by a timeout keeps these files,
    where pytest's own summary (printed only at the end) would be lost."""
    directory.mkdir(parents=True, exist_ok=True)
    parts = [report.nodeid]
    if _is_nbval_cell(item):
        parts += ["--- the cell", "".join(item.cell.source)]
        parts += ["--- what it printed", _printed(item.test_outputs or [])]
    for name, text in (("stdout", report.capstdout), ("stderr", report.capstderr)):
        if text:
            parts += [f"--- captured {name}", text]
    parts += [f"--- the failure ({report.when})", report.longreprtext]
    # one file per test and phase: a cell that failed and then errored in teardown keeps both reports
    digest = hashlib.sha1(report.nodeid.encode()).hexdigest()[:8]
    phase = "" if report.when == "call" else f".{report.when}"
    path = directory / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', report.nodeid)[:120]}-{digest}{phase}.txt"
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and os.environ.get(FAILURES_ENV):
        try:
            record_failure(item, report, Path(os.environ[FAILURES_ENV]))
        except OSError as err:  # a report that cannot be written must not end the run
            print(f"nbcapture: could not write the failure report of {report.nodeid}: {err}")
    if not _is_nbval_cell(item) or call.when != "call":
        return
    notebook = item.parent
    path = Path(str(notebook.fspath))
    if path.parent.resolve() != NOTEBOOKS_DIR.resolve():
        return
    if item.cell_num == 0:
        executed_copy(path).unlink(missing_ok=True)  # a stale copy must not outlive a failing run
        notebook._edurl_passed = set()  # the code cells that ran and passed
    if report.passed or report.skipped:
        getattr(notebook, "_edurl_passed", set()).add(item.cell_num)
    outputs = [nbformat.from_dict(out) for out in (item.test_outputs or [])]
    item.cell.outputs = outputs
    item.cell.execution_count = item.cell_num + 1
    for out in outputs:
        if out.get("output_type") == "execute_result":
            out["execution_count"] = item.cell_num + 1
    n_code = sum(cell.cell_type == "code" for cell in notebook.nb.cells)
    # every code cell ran and passed: a cell left out (--deselect, -k) would leave the book a cell without outputs
    if item.cell_num == n_code - 1 and getattr(notebook, "_edurl_passed", set()) == set(range(n_code)):
        nb = notebook.nb
        nb.metadata[STAMP_KEY] = source_stamp(path)
        EXECUTED_DIR.mkdir(parents=True, exist_ok=True)
        tmp = executed_copy(path).with_suffix(".ipynb.tmp")
        nbformat.write(nb, str(tmp))
        tmp.replace(executed_copy(path))
