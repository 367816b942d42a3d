"""Build the course as a book: `make book`, or `python book/build.py`.

1. Outputs. Every notebook in notebooks/ needs an executed copy in _build/executed/, which the notebook tests
   write as they run (book/nbcapture.py). A copy that is missing, or whose notebook or edurl sources changed
   since, is made again by running those notebooks under the same nbval command `make test` uses, so after
   `make test` the book executes nothing.
2. Staging. The book's sources are assembled under _build/book_src in the repository's own layout, so the
   links between README, chapters and notebooks resolve as they do on disk: index.md (README's title,
   introduction and course map), chapters/, notebooks/ (the executed copies, less the widget views, which need
   a live kernel), docs/glossary.md and api/ (one page per package, from the docstrings).
3. Sphinx builds _build/html with -W: any warning (a broken link or cross-reference, a bad docstring) fails it.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from book.nbcapture import ROOT, executed_copy, is_fresh  # noqa: E402

BUILD = ROOT / "_build"
SRC = BUILD / "book_src"
HTML = BUILD / "html"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# API pages: a page per package, in reading order; private modules and the exercise solutions stay out.
API_PAGES = {
    "core": (
        "edurl: seeding, devices, metrics, plotting",
        ["edurl", "edurl.utils", "edurl.metrics", "edurl.objectives", "edurl.plotting"],
    ),
    "rl": ("edurl.rl: classic RL", "edurl.rl"),
    "envs": ("edurl.envs: environments", "edurl.envs"),
    "llm": ("edurl.llm: RL for language models", "edurl.llm"),
    "recipes": ("edurl.recipes: command-line runs", "edurl.recipes"),
    "serve": ("edurl.serve: a local Tinker-compatible server", "edurl.serve"),
    "exercises": ("edurl.exercises: the checkers", "edurl.exercises"),
}


def notebooks() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def execute_stale(workers: str) -> None:
    """Run under nbval the notebooks with no fresh executed copy; the capture plugin writes the copies."""
    stale = [nb for nb in notebooks() if not is_fresh(nb)]
    if not stale:
        print("book: every notebook has a fresh executed copy in _build/executed (nothing to execute)")
        return
    print(f"book: executing {len(stale)} notebook(s) under nbval: {', '.join(nb.name for nb in stale)}")
    cmd = [sys.executable, "-m", "pytest", "-q", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider"]
    if workers not in ("", "0", "1") and len(stale) > 1:
        cmd += ["-n", workers, "--dist", "loadscope"]
    result = subprocess.run(cmd + [str(nb.relative_to(ROOT)) for nb in stale], cwd=ROOT)
    missing = [nb.name for nb in stale if not is_fresh(nb)]
    if result.returncode != 0 or missing:
        sys.exit(
            f"book: these notebooks failed under nbval, so the book has no outputs for them: {missing}. "
            "Fix them (pytest prints which cell failed) and run `make book` again."
        )


def module_names(package: str) -> list[str]:
    """`package` and its public submodules, in file order (no `_private` modules, no exercise solutions)."""
    base = ROOT / Path(*package.split("."))
    names = [package]
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if name == package or any(p.startswith("_") for p in parts) or ".solutions" in name:
            continue
        names.append(name)
    return names


def write_api_pages() -> None:
    api = SRC / "api"
    api.mkdir(parents=True)
    index = [
        "# API reference",
        "",
        "Generated from the docstrings of the `edurl` package.",
        "",
        "```{toctree}",
        ":maxdepth: 1",
        "",
    ]
    for slug, (title, package) in API_PAGES.items():
        mods = package if isinstance(package, list) else module_names(package)
        lines = [f"# {title}", ""]
        for mod in mods:
            lines += [f"## `{mod}`", "", "```{eval-rst}", f".. automodule:: {mod}", "```", ""]
        (api / f"{slug}.md").write_text("\n".join(lines), encoding="utf-8")
        index.append(slug)
    (api / "index.md").write_text("\n".join(index + ["```", ""]), encoding="utf-8")


def chapter_title(md: Path) -> str:
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    raise ValueError(f"{md} has no '# ' title line")


def readme_section(text: str, heading: str) -> str:
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    if match is None:
        raise ValueError(f"README.md has no '## {heading}' section; the book's landing page needs it")
    return match.group(0)


def write_index() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    intro = readme.split("\n## ", 1)[0]
    lines = [
        intro.rstrip(),
        "",
        readme_section(readme, "Course map").rstrip(),
        "",
        "Each chapter is followed by its notebook, run from top to bottom, with its outputs. To run a notebook "
        "yourself and move its sliders, open it in JupyterLab: `make lab`.",
        "",
        "```{toctree}",
        ":caption: The course",
        ":maxdepth: 1",
        ":hidden:",
        "",
    ]
    for md in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.md")):
        title = chapter_title(md)
        lines.append(f"{title} <chapters/{md.stem}>")
        if (ROOT / "notebooks" / f"{md.stem}.ipynb").exists():
            lines.append(f"Notebook {int(md.stem[:2])}: run it <notebooks/{md.stem}>")
    lines += [
        "```",
        "",
        "```{toctree}",
        ":caption: Reference",
        ":maxdepth: 1",
        ":hidden:",
        "",
        "docs/glossary",
        "api/index",
        "```",
        "",
    ]
    (SRC / "index.md").write_text("\n".join(lines), encoding="utf-8")


def book_notebook(executed: Path) -> nbformat.NotebookNode:
    """The executed notebook as the book shows it.

    Widget views (progress bars, the explorers' sliders) need a live kernel, so they go; the figures an
    explorer drew stay. A cell whose last line ends with ';' shows no result, as in JupyterLab (nbval's
    kernel does not store history, so IPython does not see the ';').
    """
    nb = nbformat.read(str(executed), as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        quiet = ends_with_semicolon(cell.source)
        cell.outputs = [
            out
            for out in cell.outputs
            if WIDGET_VIEW not in out.get("data", {}) and not (quiet and out.get("output_type") == "execute_result")
        ]
    return nb


def ends_with_semicolon(source: str) -> bool:
    """Whether a cell's last statement ends with ';' (a comment after it allowed), which hides its result."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):  # not Python (a cell magic's body): read the text
        return source.rstrip().endswith(";")
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT)
    last = [t for t in tokens if t.type not in skip]
    return bool(last) and last[-1].string == ";"


def stage() -> None:
    if SRC.exists():
        shutil.rmtree(SRC)
    (SRC / "notebooks").mkdir(parents=True)
    shutil.copytree(ROOT / "chapters", SRC / "chapters")
    (SRC / "docs").mkdir()
    shutil.copy2(ROOT / "docs" / "glossary.md", SRC / "docs" / "glossary.md")
    for nb in notebooks():
        nbformat.write(book_notebook(executed_copy(nb)), str(SRC / "notebooks" / nb.name))
    write_index()
    write_api_pages()


def sphinx(builder: str = "html") -> None:
    cmd = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "-E",  # read every page again: an unchanged page's warnings (a broken link) must fail every build
        "--keep-going",
        "-q",
        "-b",
        builder,
        "-c",
        str(ROOT / "book"),
        "-d",
        str(BUILD / "doctrees"),
        str(SRC),
        str(HTML),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    shutil.rmtree(HTML, ignore_errors=True)  # a removed chapter's page must not stay behind
    if subprocess.run(cmd, env=env).returncode != 0:
        sys.exit("book: Sphinx reported warnings or errors (listed above); the build fails on any warning (-W).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workers",
        default=os.environ.get("PYTEST_WORKERS", "2"),
        help="pytest-xdist workers for notebooks that must be executed (default: 2)",
    )
    parser.add_argument(
        "--no-execute",
        action="store_true",
        help="fail instead of executing notebooks whose executed copy is missing or stale",
    )
    args = parser.parse_args()
    if args.no_execute:
        stale = [nb.name for nb in notebooks() if not is_fresh(nb)]
        if stale:
            sys.exit(f"book: no fresh executed copy of {stale} in _build/executed; run `make test` or `make book`")
    else:
        execute_stale(args.workers)
    stage()
    sphinx()
    print(f"book: built {HTML / 'index.html'}")


if __name__ == "__main__":
    main()
