"""Run the notebooks as a learner who solved every exercise runs them: the worked solutions in place of the stubs.

CI runs the notebooks as they ship. Each exercise cell is a stub, its checker says "not attempted", and the library's
implementation (the verdict's ``implementation``) carries the rest of the notebook. A learner who passes an exercise
carries their own function instead, so a later cell that needs more of it than the checker asks for fails only for
them. One did: notebook 10's cell after exercise 10.3 read ``optim/kl_sample_train_v2`` from the learner's step,
which the worked solution did not return (fixed in ``b53ef55``).

This writes a copy of each notebook to ``_build/solved/`` in which every exercise cell binds the worked solution from
``edurl.exercises.solutions`` just before its check, and asserts that the check passed; then it runs the copies
under the same nbval command as ``make notebooks``. It is not part of ``make test``, which it would make twice as
long; run it when a checker, a worked solution or a notebook changes::

    python tests/solved_notebooks.py              # every notebook (about as long as make notebooks)
    python tests/solved_notebooks.py 07 10        # some, by number
    python tests/solved_notebooks.py --write-only # only write the copies

Failures are also written, cell by cell as they happen, to ``_build/solved/failures/``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "_build" / "solved"
CHECK_LINE = re.compile(r"^(\w+) = exercises\.(check_\w+)\((\w+)", re.M)

#: What an exercise cell binds, by the name its checker is given, where it is not ``name = _solved.name``.
BINDINGS = {
    "clip_table": "clip_table = _solved.clip_table()",
    "clip_values": "clip_values = _solved.clip_values()",
    "make_env": ('def make_env():\n    return _solved.ReverseWordEnv("stop", renderer)\n\n\nRIGHT_REPLY = "pots"'),
}


def solve_notebook(nb: dict, chapter: int) -> tuple[dict, list[str]]:
    """A copy of notebook ``nb`` (chapter ``chapter``) whose exercise cells bind the worked solutions before their
    checks and assert that the checks passed; and the names it bound, in order. Raises if an exercise cell's check
    is not found or the solutions module lacks what the cell needs."""
    module = f"edurl.exercises.solutions.ch{chapter:02d}"
    solutions = importlib.import_module(module)
    nb = copy.deepcopy(nb)
    bound = []
    for cell in nb["cells"]:
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] != "code" or "exercises.check_" not in source:
            continue
        if len(re.findall(r"exercises\.check_\w+\(", source)) > 1:
            raise ValueError(f"chapter {chapter}: a cell holds two exercise checks; give each exercise its own cell")
        match = CHECK_LINE.search(source)
        if match is None:
            raise ValueError(f"chapter {chapter}: an exercise cell has no `v = exercises.check_...(name...)` line")
        verdict, checker, name = match.groups()
        binding = BINDINGS.get(name, f"{name} = _solved.{name}")
        for needed in re.findall(r"_solved\.(\w+)", binding):
            if not hasattr(solutions, needed):
                raise ValueError(
                    f"{module} has no `{needed}` for {checker}; add the worked solution or a BINDINGS entry"
                )
        lines = source.split("\n")
        call = next(
            node
            for node in ast.parse(source).body
            if isinstance(node, ast.Assign) and node.lineno == source[: match.start()].count("\n") + 1
        )
        before, check, after = (
            lines[: call.lineno - 1],
            lines[call.lineno - 1 : call.end_lineno],
            lines[call.end_lineno :],
        )
        source = "\n".join(
            [
                *before,
                f"import {module} as _solved  # solved copy (tests/solved_notebooks.py): the worked solution",
                binding,
                *check,
                f"assert {verdict}.passed, {verdict}.message",
                *after,
            ]
        )
        cell["source"] = source
        bound.append(name)
    return nb, bound


def write_solved(numbers: list[str] | None = None) -> list[Path]:
    """Write the solved copies of the notebooks (all, or those whose names start with ``numbers``); their paths."""
    OUT.mkdir(parents=True, exist_ok=True)
    paths = []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        if numbers and path.name[:2] not in numbers:
            continue
        nb = json.loads(path.read_text(encoding="utf-8"))
        solved, _ = solve_notebook(nb, int(path.name[:2]))
        target = OUT / path.name
        target.write_text(json.dumps(solved, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        paths.append(target)
    if numbers and len(paths) != len(numbers):
        raise SystemExit(f"no notebook for some of {numbers}; give two-digit numbers, e.g. 07 10")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("numbers", nargs="*", help="two-digit notebook numbers (default: all)")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    parser.add_argument("--write-only", action="store_true", help="write the copies, do not run them")
    args = parser.parse_args(argv)
    paths = write_solved(args.numbers)
    print(f"wrote {len(paths)} solved notebook(s) to {OUT.relative_to(ROOT)}/")
    if args.write_only:
        return 0
    env = {**os.environ, "EDURL_FAILURES_DIR": str(OUT / "failures")}
    command = [sys.executable, "-m", "pytest", "-n", str(args.workers), "--dist", "loadscope", "-p", "no:cacheprovider"]
    command += [*map(str, paths), "--nbval-lax", "--nbval-current-env", "-rf"]
    return subprocess.run(command, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
