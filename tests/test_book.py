"""The book's build pieces, without a browser: the nbval output capture (book/nbcapture.py), the staleness
stamp that decides whether `make book` must execute a notebook again, and what the book shows of a notebook."""

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from book import build, nbcapture

ROOT = Path(__file__).resolve().parents[1]


def _notebook(tmp_path: Path, cells, name="01_demo.ipynb") -> Path:
    folder = tmp_path / "notebooks"
    folder.mkdir(exist_ok=True)
    path = folder / name
    nbformat.write(
        new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}}), str(path)
    )
    return path


def _run_nbval(tmp_path: Path, notebook: Path):
    """pytest --nbval-lax on one notebook with the capture plugin, writing copies to tmp_path/executed."""
    env = dict(
        os.environ,
        EDURL_BOOK_NOTEBOOKS=str(notebook.parent),
        EDURL_BOOK_EXECUTED=str(tmp_path / "executed"),
        PYTHONPATH=str(ROOT),
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "book.nbcapture",
            "-p",
            "no:cacheprovider",
            "--nbval-lax",
            "--nbval-current-env",
            str(notebook),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_passing_notebook_is_saved_with_its_outputs_and_stamp(tmp_path):
    nb = _notebook(tmp_path, [new_markdown_cell("# demo"), new_code_cell("print('hello')"), new_code_cell("6 * 7")])
    result = _run_nbval(tmp_path, nb)
    assert result.returncode == 0, result.stdout + result.stderr
    copy = json.loads((tmp_path / "executed" / nb.name).read_text(encoding="utf-8"))
    code = [c for c in copy["cells"] if c["cell_type"] == "code"]
    assert "".join(code[0]["outputs"][0]["text"]) == "hello\n"
    assert "".join(code[1]["outputs"][0]["data"]["text/plain"]) == "42"
    assert [c["execution_count"] for c in code] == [1, 2]
    assert copy["metadata"]["edurl_execution"]["notebook_sha256"] == nbcapture.source_stamp(nb)["notebook_sha256"]


def test_a_failing_notebook_leaves_no_copy_not_even_an_old_one(tmp_path):
    nb = _notebook(
        tmp_path,
        [new_code_cell("x = 1"), new_code_cell("assert x == 2, 'x is not 2'"), new_code_cell("print('after')")],
    )
    old = tmp_path / "executed" / nb.name
    old.parent.mkdir()
    old.write_text("{}")  # a copy from an earlier, passing version of the notebook
    result = _run_nbval(tmp_path, nb)
    assert result.returncode != 0
    assert not old.exists()


def test_a_run_that_left_out_a_cell_writes_no_copy(tmp_path):
    # --deselect (or -k) once gave a fresh copy with that cell's outputs missing, which the book then showed
    nb = _notebook(tmp_path, [new_code_cell("print('one')"), new_code_cell("print('two')"), new_code_cell("3")])
    env = dict(
        os.environ,
        EDURL_BOOK_NOTEBOOKS=str(nb.parent),
        EDURL_BOOK_EXECUTED=str(tmp_path / "executed"),
        PYTHONPATH=str(ROOT),
    )
    args = ["-p", "book.nbcapture", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env", str(nb)]
    cmd = [sys.executable, "-m", "pytest", "-q", *args, "--deselect", f"{nb.relative_to(tmp_path)}::Cell 1"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "1 deselected" in result.stdout, result.stdout + result.stderr
    assert not (tmp_path / "executed" / nb.name).exists()


def test_the_stamp_goes_stale_when_the_notebook_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(nbcapture, "EXECUTED_DIR", tmp_path / "executed")
    nb = _notebook(tmp_path, [new_code_cell("1 + 1")])
    assert not nbcapture.is_fresh(nb)  # no copy yet
    copy = nbformat.read(str(nb), as_version=4)
    copy.metadata[nbcapture.STAMP_KEY] = nbcapture.source_stamp(nb)
    (tmp_path / "executed").mkdir()
    nbformat.write(copy, str(nbcapture.executed_copy(nb)))
    assert nbcapture.is_fresh(nb)
    nb.write_text(nb.read_text(encoding="utf-8").replace("1 + 1", "1 + 2"))
    assert not nbcapture.is_fresh(nb)


def test_the_stamp_covers_the_library_too(tmp_path, monkeypatch):
    nb = _notebook(tmp_path, [new_code_cell("1 + 1")])
    before = nbcapture.source_stamp(nb)
    fake_root = tmp_path / "root"
    (fake_root / "edurl").mkdir(parents=True)
    (fake_root / "edurl" / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(nbcapture, "ROOT", fake_root)
    one = nbcapture.source_stamp(nb)
    (fake_root / "edurl" / "a.py").write_text("x = 2\n")
    assert nbcapture.source_stamp(nb)["edurl_sha256"] != one["edurl_sha256"]
    assert one["notebook_sha256"] == before["notebook_sha256"]


def test_the_book_drops_widget_views_and_quiet_results_but_keeps_figures(tmp_path):
    widget = new_output(
        "display_data",
        data={"application/vnd.jupyter.widget-view+json": {"model_id": "x"}, "text/plain": "  0%|          | 0/10"},
    )
    figure = new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})
    result = new_output("execute_result", data={"text/plain": "<function f>"}, execution_count=1)
    nb = _notebook(
        tmp_path,
        [
            new_code_cell("widgets.interact(f);", outputs=[figure, widget, result]),
            new_code_cell("f", outputs=[result]),
        ],
    )
    shown = build.book_notebook(nb)
    assert [o["output_type"] for o in shown.cells[0].outputs] == ["display_data"]
    assert "image/png" in shown.cells[0].outputs[0]["data"]
    assert [o["output_type"] for o in shown.cells[1].outputs] == ["execute_result"]  # no ';': the result shows


@pytest.mark.parametrize(
    "source, quiet",
    [
        ("plt.plot(x);", True),
        ("plt.plot(x);  # draw it", True),  # the comment once let the result through
        ("f(x)\n# a note;", False),  # the ';' is in a comment
        ("s = 'a;'\ns", False),
        ("for i in range(2):\n    g(i);", True),
        ("%%time\nx = 1;", True),
        ("", False),
    ],
)
def test_a_trailing_semicolon_is_read_as_ipython_reads_it(source, quiet):
    assert build.ends_with_semicolon(source) == quiet


def test_landing_page_has_the_course_map_and_reads_chapter_then_notebook(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "SRC", tmp_path)
    build.write_index()
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert "## Course map" in index
    entries = [line.split("<")[-1].rstrip(">") for line in index.splitlines() if line.endswith(">")]
    chapters = sorted(p.stem for p in (ROOT / "chapters").glob("[0-9][0-9]_*.md"))
    expected = [e for stem in chapters for e in (f"chapters/{stem}", f"notebooks/{stem}")]
    assert entries == expected


def test_readme_without_a_course_map_fails_with_a_clear_error():
    with pytest.raises(ValueError, match="Course map"):
        build.readme_section("# title\n\n## Other\ntext\n", "Course map")
