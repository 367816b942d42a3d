"""Browser tests: the book (_build/html) and JupyterLab, driven by Playwright with the system's Chromium.

Playwright cannot download its own browsers here, so the tests launch an installed Chromium (Debian's
`chromium`; `EDURL_CHROMIUM` names another binary). `make test` installs Debian's chromium first when none is
found and apt-get is usable as root. Where a test cannot run (no Chromium, no built book) it is skipped with
the reason, except under CI=true, where that is a failure: CI must not pass by skipping them.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import socket
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "_build"
HTML = BUILD / "html"
SCREENSHOTS = BUILD / "screenshots"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(reason: str):
    """Skip, or fail under CI=true: a browser test that silently skipped in CI would prove nothing."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true, where a skipped browser test is a failure)", pytrace=False)
    pytest.skip(reason)


def find_chromium() -> str | None:
    named = os.environ.get("EDURL_CHROMIUM")
    if named:
        return shutil.which(named) or (named if Path(named).exists() else None)
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright is not installed: pip install -e '.[dev]'")
    path = find_chromium()
    if path is None:
        unavailable(
            f"no Chromium found (looked for {', '.join(CHROMIUM_NAMES)} and $EDURL_CHROMIUM); "
            "install Debian's chromium (apt-get install chromium), or run `make test` as root to have it installed"
        )
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path)
        yield b
        b.close()


@pytest.fixture(scope="session")
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def book_url():
    """The built book, served over HTTP on a free localhost port (as a reader's browser would load it)."""
    if not (HTML / "index.html").exists():
        unavailable(f"no built book at {HTML}: run `make book` first")
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", free_port()), functools.partial(_QuietHandler, directory=str(HTML))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
