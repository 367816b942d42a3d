"""Sphinx configuration of the course book (`make book`; see book/build.py).

The source folder is a staged copy that book/build.py assembles under _build/book_src: the landing page
(README's course map), chapters/, notebooks/ (the copies executed by the notebook tests, with outputs),
docs/glossary.md and the API pages. Nothing here fetches anything from the network: notebooks are not
executed by Sphinx, MathJax is served from a local copy, and no widget JavaScript is loaded.
"""

import importlib.util
import os
import shutil
from pathlib import Path

import edurl

project = "edurl"
author = "the edurl authors"
copyright = "the edurl authors (MIT licence)"
release = edurl.__version__
version = edurl.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]

root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]

# MyST: $...$ and $$...$$ maths as the chapters and notebooks write it; heading anchors for #section links.
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
# The notebooks arrive executed (book/build.py reuses the executions of the notebook tests): never run them here.
nb_execution_mode = "off"
# No widget JavaScript: it would come from a CDN. build.py drops the widget views, whose outputs the
# book shows as the figures they drew; the live explorers run in JupyterLab.
nb_ipywidgets_js = {}

# MathJax 3 from a local copy (the sphinx-mathjax-offline package), copied into _static/mathjax.
_MATHJAX_SPEC = importlib.util.find_spec("sphinx-mathjax-offline")
if _MATHJAX_SPEC is None or _MATHJAX_SPEC.origin is None:
    raise RuntimeError("the book needs a local MathJax: pip install -e '.[dev]' installs sphinx-mathjax-offline")
MATHJAX_DIR = Path(_MATHJAX_SPEC.origin).parent / "static" / "mathjax"
mathjax_path = "mathjax/tex-chtml.js"


def _copy_mathjax(app, exc):
    if exc is None:
        shutil.copytree(MATHJAX_DIR, os.path.join(app.outdir, "_static", "mathjax"), dirs_exist_ok=True)


# API pages from the docstrings.
# Package pages document what each module defines, not what __init__ re-exports (no duplicate targets).
autodoc_default_options = {"members": True, "member-order": "bysource", "ignore-module-all": True}
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Code and commands keep their characters: smart quotes turned --flag into an en dash, and a pasted command failed.
smartquotes = False


def literal_commands(app, what, name, obj, options, lines) -> None:
    """Show a docstring's indented block of shell commands as code. Without a '::' before it, reStructuredText
    reads it as a quotation: its lines run into one paragraph. The docstrings stay as they are, since a
    recipe's --help prints them."""
    commands = ("python ", "torchrun ", "make ", "pip ", "TINKER_API_KEY=")
    i = 1
    while i < len(lines):
        line, before = lines[i], lines[i - 1]
        if line.startswith("    ") and line.lstrip().startswith(commands) and not before.strip():
            if i < 2 or not lines[i - 2].rstrip().endswith("::"):
                lines[i - 1 : i] = ["", "::", ""]
                i += 2
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                i += 1
        i += 1


html_theme = "sphinx_book_theme"
html_title = "edurl: RL for LLMs, by building it"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
    "home_page_in_toc": True,
}
html_last_updated_fmt = None
# The theme reads its light/dark mode from here; left empty, its script logs "invalid theme mode" on every page.
html_context = {"default_mode": "auto"}


def setup(app):
    app.connect("build-finished", _copy_mathjax)
    app.connect("autodoc-process-docstring", literal_commands)
