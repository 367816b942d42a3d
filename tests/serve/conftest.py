"""A live edurl.serve on a free localhost port, started as `python -m edurl.serve` (the public command)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "tinker", reason="the tinker SDK (Python >= 3.11) is in the tinker extra: pip install -e '.[tinker]'"
)

from edurl.serve.launch import LocalServer  # noqa: E402

KEY = "tml-edurl-test-key"


@pytest.fixture(scope="session")
def server_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with LocalServer(device="cpu", api_key=KEY, log=str(log)) as server:
        yield server.url


@pytest.fixture(autouse=True)
def _sdk_env(monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
