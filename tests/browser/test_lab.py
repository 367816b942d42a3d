"""JupyterLab in a real browser, started by `make lab` itself: every notebook with widget explorers runs
top to bottom without an error, draws its progress bars as widgets, and redraws its figure when a slider moves.

Each test starts `make lab` with this environment (`VENV=sys.prefix`, its setup step taken as done), a free
port, a token, no browser, and a settings folder of its own, so the command the README gives is the one
tested, `--allow-root` included when the tests run as root.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import BUILD, ROOT, free_port, unavailable

pytestmark = pytest.mark.browser

WIDGET_NOTEBOOKS = sorted(
    p.name
    for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")
    if "widgets.interact(" in p.read_text(encoding="utf-8")
)
TEXT_PROGRESS_BAR = re.compile(r"\d+%\|[^|\n]*\|\s*\d+/\d+")
# Lab settings of the test's own: no autosave (the notebooks in the repository stay without outputs), every
# cell in the DOM (no windowing), no news or update checks (offline).
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}
RUN_ALL_TIMEOUT_S = 900


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as res:
            return res.status
    except OSError:
        return 0


def jupyter_env(work: Path) -> dict:
    """The environment for `make lab`: Jupyter's data, config and runtime folders in `work`, so the kernel that
    `make lab` registers (--user) goes there, pointing at this environment, and the user's own kernels and
    settings (perhaps an "edurl" kernel of a venv since deleted) play no part."""
    env = dict(os.environ)
    for var in ("JUPYTER_DATA_DIR", "JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR"):
        env[var] = str(work / var.lower())
    return env


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """`make lab` on a free port; yields (base URL, token) and stops the server afterwards."""
    if shutil.which("make") is None:
        unavailable("`make` is not installed; the JupyterLab tests start JupyterLab with `make lab`")
    work = tmp_path_factory.mktemp("lab")
    settings = work / "settings"
    for rel, value in LAB_SETTINGS.items():
        (settings / rel).parent.mkdir(parents=True, exist_ok=True)
        (settings / rel).write_text(json.dumps(value))
    port, token = free_port(), secrets.token_hex(16)
    venv = Path(sys.prefix)
    lab_args = (
        f"--no-browser --port={port} --ServerApp.port_retries=0 --IdentityProvider.token={token} "
        f"--LabApp.user_settings_dir={settings} --LabApp.workspaces_dir={work / 'workspaces'}"
    )
    untouched = {p: p.read_bytes() for p in (ROOT / "notebooks").glob("*.ipynb")}
    log = (work / "lab.log").open("w")
    # -o: this environment counts as set up (make setup would otherwise build a venv at VENV).
    proc = subprocess.Popen(
        [
            "make",
            "--no-print-directory",
            "-o",
            f"{venv}/.edurl-installed",
            "lab",
            f"VENV={venv}",
            f"LAB_ARGS={lab_args}",
        ],
        cwd=ROOT,
        env=jupyter_env(work),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while _get(f"{base}/api/status?token={token}") != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            log.close()
            pytest.fail(
                f"`make lab` did not serve JupyterLab (exit status {proc.poll()}):\n"
                + (work / "lab.log").read_text(encoding="utf-8")[-3000:],
                pytrace=False,
            )
        time.sleep(0.5)
    yield base, token
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()
    written = [p.name for p, data in untouched.items() if p.read_bytes() != data]
    assert written == [], f"JupyterLab saved outputs into the repository's notebooks: {written}"


def expects_progress_bar(name: str) -> bool:
    """Whether the notebook's executed copy (from nbval) shows a tqdm bar; without a copy, assume it does."""
    copy = BUILD / "executed" / name
    if not copy.exists():
        return True
    nb = json.loads(copy.read_text(encoding="utf-8"))
    return any(
        "application/vnd.jupyter.widget-view+json" in out.get("data", {})
        and TEXT_PROGRESS_BAR.search("".join(out["data"].get("text/plain", "")))
        for cell in nb["cells"]
        if cell["cell_type"] == "code"
        for out in cell.get("outputs", [])
    )


def accept_kernel_dialog(page) -> None:
    """JupyterLab may ask which kernel to start (make lab registers "Python (edurl)" beside "Python 3"):
    take its preselected choice, as a learner pressing Enter would."""
    try:
        page.wait_for_selector(".jp-Dialog", timeout=10_000)
    except Exception:  # no dialog: the notebook's own kernel started
        return
    page.locator(".jp-Dialog .jp-mod-accept").click()
    page.wait_for_selector(".jp-Dialog", state="detached")


def run_all_cells(page) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    prompts = page.locator(".jp-CodeCell .jp-InputPrompt")
    # Wait for execution to start, then for no cell to be running or queued ([*]).
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))",
        timeout=60_000,
    )
    deadline = time.monotonic() + RUN_ALL_TIMEOUT_S
    while any("[*]" in t for t in prompts.all_text_contents()):
        assert time.monotonic() < deadline, f"Run All did not finish in {RUN_ALL_TIMEOUT_S} s"
        time.sleep(1)


def kernels_idle(base: str, token: str) -> bool:
    req = urllib.request.Request(f"{base}/api/kernels", headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=5) as res:
        return all(k["execution_state"] == "idle" for k in json.loads(res.read()))


def settle(page, explorer, base: str, token: str, quiet_s: float = 2.0, timeout_s: float = 120) -> None:
    """Wait until every redraw a slider move queued has run: kernels idle and the figure unchanged for quiet_s."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        src = explorer.locator("img").first.get_attribute("src")
        if src != last or not kernels_idle(base, token):
            last, since = src, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.25)
    raise AssertionError(f"the explorer's figure did not settle within {timeout_s} s")


def output_texts(page) -> list[str]:
    return page.locator(".jp-OutputArea-output").all_inner_texts()


@pytest.mark.parametrize("name", WIDGET_NOTEBOOKS or [None])
def test_widget_notebook_runs_in_jupyterlab(browser, lab, name, screenshots):
    if name is None:
        pytest.fail("no notebook uses widgets.interact: the explorers of notebooks 04-06 are gone?")
    base, token = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    stem = name.removesuffix(".ipynb")
    source = (ROOT / "notebooks" / name).read_bytes()
    try:
        # A workspace of its own per notebook, reset: no tab of an earlier test is restored beside it.
        page.goto(f"{base}/lab/workspaces/{stem}/tree/{name}?reset&token={token}")
        page.wait_for_selector(".jp-Notebook .jp-CodeCell")
        accept_kernel_dialog(page)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
        run_all_cells(page)
        page.screenshot(path=str(screenshots / f"lab_{stem}_run_all.png"), full_page=False)

        # Every code cell ran (Run All stops at an error), and no cell shows a traceback.
        prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_text_contents()
        unrun = [i for i, p in enumerate(prompts) if not re.search(r"\[\d+\]", p)]
        tracebacks = [t[:500] for t in output_texts(page) if "Traceback" in t or "Error:" in t.split("\n")[0]]
        assert tracebacks == [], f"{name}: cells failed in JupyterLab:\n" + "\n---\n".join(tracebacks[:3])
        assert unrun == [], f"{name}: code cells {unrun} did not run"

        # Progress bars are widgets, not text.
        text_bars = [t[:120] for t in output_texts(page) if TEXT_PROGRESS_BAR.search(t)]
        assert text_bars == [], f"{name}: progress bars drawn as text, not widgets: {text_bars[:3]}"
        if expects_progress_bar(name):
            assert page.locator(".widget-hprogress").count() > 0, f"{name}: no progress-bar widget rendered"

        # Each explorer: move one slider, and the figure must change.
        explorers = page.locator(".widget-interact")
        assert explorers.count() > 0, f"{name}: no interact explorer rendered (widgets.interact in the notebook)"
        for k in range(explorers.count()):
            explorer = explorers.nth(k)
            explorer.scroll_into_view_if_needed()
            image = explorer.locator("img").first
            image.wait_for()
            before = image.get_attribute("src")
            readout = explorer.locator(".widget-readout").first
            value_before = readout.inner_text()
            handle = explorer.locator(".noUi-handle").first
            handle.focus()
            for _ in range(3):
                page.keyboard.press("ArrowLeft")
            page.wait_for_function(
                "([el, src]) => { const img = el.querySelector('img'); return img && img.src !== src; }",
                arg=[explorer.element_handle(), before],
                timeout=60_000,
            )
            assert readout.inner_text() != value_before, f"{name}: the slider's value did not move"
            settle(page, explorer, base, token)
            assert image.get_attribute("src") != before, f"{name}: the figure is the same after the slider moved"
            page.screenshot(path=str(screenshots / f"lab_{stem}_explorer{k}.png"))
        assert (ROOT / "notebooks" / name).read_bytes() == source, f"JupyterLab wrote to notebooks/{name}"
    except Exception:
        page.screenshot(path=str(screenshots / f"lab_{stem}_failure.png"))
        raise
    finally:
        page.close()
