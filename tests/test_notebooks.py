"""The notebook conventions of COURSE.md, enforced. (nbval runs the notebooks themselves.)"""

import json
import re
from pathlib import Path

import pytest

import edurl.exercises

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CHAPTERS = sorted((ROOT / "chapters").glob("*.md"))
NAME = re.compile(r"^\d\d_[a-z0-9_]+$")
SECTIONS = [
    "Learning objectives",
    "Prerequisites",
    "Concepts",
    "Code walkthrough",
    "Try it yourself",
    "Self-check answers",
    "Key takeaways",
    "What's next",
    "Further reading",
]


def _code_cells(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _source(cell):
    return "".join(cell["source"])


def test_there_are_notebooks_and_chapters():
    assert NOTEBOOKS and CHAPTERS


def test_every_notebook_has_its_chapter_and_every_chapter_its_notebook():
    assert {p.stem for p in NOTEBOOKS} == {p.stem for p in CHAPTERS}
    for p in NOTEBOOKS + CHAPTERS:
        assert NAME.match(p.stem), f"{p.name}: name it NN_slug"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_committed_outputs(path):
    for cell in _code_cells(path):
        assert cell.get("outputs") == [] and cell.get("execution_count") is None, (
            f"{path.name} has outputs: clear them (Kernel > Restart and Clear Outputs) before committing"
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cell_has_a_unique_id(path):
    """nbformat 4.5 gives every cell an id; a cell added by a script without one makes nbformat warn on every read
    (a hard error in future versions)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert (nb["nbformat"], nb["nbformat_minor"]) >= (4, 5), f"{path.name}: save it as nbformat 4.5 or later"
    ids = [cell.get("id") for cell in nb["cells"]]
    missing = [i for i, cell_id in enumerate(ids) if not cell_id]
    assert not missing, f"{path.name}: cells {missing} have no id (nbformat.validator.normalize adds them)"
    assert len(set(ids)) == len(ids), f"{path.name}: two cells share an id"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_cell_imports_edurl_seeds_and_prints_device(path):
    first = _source(_code_cells(path)[0])
    assert "import edurl" in first and "edurl.seed_everything(" in first and "edurl.device()" in first
    assert "print(" in first


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_claims_are_asserted(path):
    asserts = [c for c in _code_cells(path) if re.search(r"^\s*assert ", _source(c), re.M)]
    assert len(asserts) >= 2, f"{path.name}: prove what the notebook claims with assert cells"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_exercises_use_existing_checkers_and_leave_stubs(path):
    sources = [_source(c) for c in _code_cells(path)]
    for name in re.findall(r"exercises\.(check_\w+)\(", "\n".join(sources)):
        assert hasattr(edurl.exercises, name), f"{path.name} calls exercises.{name}, which does not exist"
    for src in sources:
        if "exercises.check_" in src:  # the exercise cell ships as a stub; solutions live in edurl.exercises
            # a function stub raises NotImplementedError; a table exercise (Chapter 5) ships with None cells
            assert "raise NotImplementedError" in src or re.search(r"[:(]\s*None\b", src), src[:200]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_kernel_is_plain_python3(path):
    assert json.loads(path.read_text(encoding="utf-8"))["metadata"]["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_follows_the_structure(path):
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert lines[0].startswith("# "), "first line: the title"
    assert any(line.startswith("> *") for line in lines[1:4]), "an epigraph right under the title"
    positions = []
    for section in SECTIONS:
        match = re.search(rf"^## {re.escape(section)}", text, re.M)
        assert match, f"{path.name} lacks the section '## {section}'"
        positions.append(match.start())
    assert positions == sorted(positions), f"{path.name}: sections must come in the order {SECTIONS}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_names_only_files_that_exist(path):
    for ref in set(
        re.findall(r"`((?:edurl|tests|notebooks|benchmarks)/[\w/.]+\.(?:py|ipynb))`", path.read_text(encoding="utf-8"))
    ):
        assert (ROOT / ref).exists(), f"{path.name} mentions {ref}, which does not exist"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_opens_with_objectives_and_time_and_closes_with_self_check(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    first, last = _source(cells[0]), _source(cells[-1])
    assert "**In this notebook you will:**" in first and "**Time:**" in first, f"{path.name}: objectives and time"
    questions = re.findall(r"^\d+\. ", last.split("## Check yourself", 1)[-1], re.M)
    assert "## Check yourself" in last and 3 <= len(questions) <= 5, f"{path.name}: 3-5 self-check questions"
    chapter = ROOT / "chapters" / f"{path.stem}.md"
    answers = chapter.read_text(encoding="utf-8").split("## Self-check answers", 1)[1].split("\n## ", 1)[0]
    assert len(re.findall(r"^\d+\. ", answers, re.M)) == len(questions), f"{chapter.name}: one answer per question"
