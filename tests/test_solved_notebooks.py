"""tests/solved_notebooks.py (run by hand, not by make test) builds its copies right: every exercise cell of every
notebook binds a worked solution that exists, and every cell still parses."""

import ast
import json
from pathlib import Path

import pytest

from tests.solved_notebooks import BINDINGS, solve_notebook

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_exercise_cell_binds_its_worked_solution(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    solved, bound = solve_notebook(nb, int(path.name[:2]))
    checked = [
        "".join(c["source"]).split("exercises.check_", 1)[1].split("(", 1)[1].split(")", 1)[0].split(",")[0]
        for c in nb["cells"]
        if c["cell_type"] == "code" and "exercises.check_" in "".join(c["source"])
    ]
    assert bound == checked and bound
    cells = [c["source"] for c in solved["cells"] if c["cell_type"] == "code" and "exercises.check_" in c["source"]]
    for name, src in zip(bound, cells):  # the solution bound before the check, the assert after it
        verdict = src.split(" = exercises.check_", 1)[0].rsplit("\n", 1)[-1]
        check = src.index(f"{verdict} = exercises.check_")
        binding = BINDINGS.get(name, f"{name} = _solved.{name}")
        assert src.index("import edurl.exercises.solutions.ch") < src.index(binding) < check
        assert src.index(f"assert {verdict}.passed", check) > check
    for cell in solved["cells"]:
        if cell["cell_type"] == "code":
            src = cell["source"]
            ast.parse(src if isinstance(src, str) else "".join(src))
    assert nb != solved and json.loads(path.read_text(encoding="utf-8")) == nb  # a copy; the notebook is untouched


def test_a_check_without_a_worked_solution_is_refused():
    nb = {"cells": [{"cell_type": "code", "source": "v = exercises.check_gae(no_such_function)\n"}]}
    with pytest.raises(ValueError, match="has no `no_such_function`"):
        solve_notebook(nb, 4)


def test_a_cell_with_two_checks_is_refused():
    nb = {"cells": [{"cell_type": "code", "source": "v = exercises.check_gae(gae)\nw = exercises.check_gae(gae)\n"}]}
    with pytest.raises(ValueError, match="two exercise checks"):
        solve_notebook(nb, 4)
