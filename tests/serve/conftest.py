"""A live edurl.serve on a free localhost port, started as `python -m edurl.serve` (the public command)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip(
    "tinker", reason="the tinker SDK (Python >= 3.11) is in the tinker extra: pip install -e '.[tinker]'"
)

KEY = "tml-edurl-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"edurl.serve exited with status {proc.returncode}")
        try:
            req = urllib.request.Request(f"{url}/api/v1/healthz", headers={"X-API-Key": KEY})
            with urllib.request.urlopen(req, timeout=2) as res:
                if res.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("edurl.serve did not come up")


@pytest.fixture(scope="session")
def server_url(tmp_path_factory):
    port = free_port()
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "edurl.serve", "--port", str(port), "--api-key", KEY, "--device", "cpu"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(autouse=True)
def _sdk_env(monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
