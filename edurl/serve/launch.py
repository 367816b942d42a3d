"""Start ``python -m edurl.serve`` in a subprocess on a free localhost port, and stop it again."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """``python -m edurl.serve`` on 127.0.0.1, for a notebook, a test or a benchmark.

    It preloads ``edurl/tiny-arithmetic`` (Chapter 6's checkpoint) unless told otherwise.
    ``with LocalServer() as server:`` gives ``server.url`` and ``server.api_key`` for
    ``tinker.ServiceClient(base_url=server.url, api_key=server.api_key)``; the server stops when the block ends
    (or at ``stop()``). Its output goes to ``log`` (a file path), or nowhere. Checkpoints (``save_state``) go
    to ``state_dir``, kept afterwards, or to a temporary folder that ``stop()`` removes.
    """

    def __init__(
        self,
        device: str | None = None,
        api_key: str | None = None,
        log: str | None = None,
        preload: tuple[str, ...] = ("edurl/tiny-arithmetic",),
        state_dir: str | None = None,
    ):
        self.api_key = api_key or "tml-" + secrets.token_urlsafe(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.device, self.log, self.preload = device, log, preload
        self.state_dir = state_dir
        self._made_state_dir = False  # whether state_dir is a temporary folder of ours, to remove at stop()
        self.proc: subprocess.Popen | None = None
        self._out = None

    def start(self, timeout: float = 900.0) -> LocalServer:
        """Start the server and wait until it answers (preloading may train the course's checkpoint first)."""
        cmd = [sys.executable, "-m", "edurl.serve", "--port", str(self.port), "--api-key", self.api_key]
        if self.state_dir is None:
            # made here, not left to the server: it removes its own folder when it exits, but terminate() on
            # Windows ends it without running its exit hooks, and every run left an edurl-serve-* folder behind
            self.state_dir, self._made_state_dir = tempfile.mkdtemp(prefix="edurl-serve-"), True
        cmd += ["--state-dir", str(self.state_dir)]
        if self.device is not None:
            cmd += ["--device", str(self.device)]
        for name in self.preload:
            cmd += ["--preload", name]
        try:  # a failed or interrupted start stops the server and removes the state folder it was given
            self._out = open(self.log, "w") if self.log else None  # noqa: SIM115 - closed in stop()
            out = self._out or subprocess.DEVNULL
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    status = self.proc.returncode
                    self.stop()  # closes the log and removes the state folder
                    raise RuntimeError(
                        f"edurl.serve exited with status {status}" + (f"; see {self.log}" if self.log else "")
                    )
                try:
                    req = urllib.request.Request(f"{self.url}/api/v1/healthz", headers={"X-API-Key": self.api_key})
                    with urllib.request.urlopen(req, timeout=2) as res:
                        if res.status == 200:
                            return self
                except OSError:
                    time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        self.stop()
        raise RuntimeError(f"edurl.serve did not answer on {self.url} within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()  # Windows cannot remove the folder while the process still has files open there
        self.proc = None
        if self._out is not None:
            self._out.close()
            self._out = None
        if self._made_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            self.state_dir, self._made_state_dir = None, False  # a later start() makes a new one

    def __enter__(self) -> LocalServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
