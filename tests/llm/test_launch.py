"""edurl.llm.distributed.launch: runs python or torchrun in a process group of its own, and stops all of it."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edurl.llm.distributed import launch

posix_only = pytest.mark.skipif(not hasattr(os, "killpg") or not Path("/proc").is_dir(), reason="needs /proc")

# a parent that starts a child (as torchrun starts its ranks), writes the child's pid, and waits
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "open(sys.argv[1], 'w').write(str(child.pid))\n"
    "time.sleep(120)\n"
)


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an exited child its new parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _child_pid(path: Path, within: float = 30.0) -> int:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if path.exists() and path.read_text(encoding="utf-8"):
            return int(path.read_text(encoding="utf-8"))
        time.sleep(0.05)
    raise AssertionError("the parent never wrote its child's pid")


def _gone(pid: int, within: float = 10.0) -> bool:
    end = time.monotonic() + within
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not _alive(pid)


def test_launch_returns_what_the_process_printed():
    done = launch(["-c", "import sys; print('out'); print('err', file=sys.stderr)"])
    assert (done.returncode, done.stdout, done.stderr) == (0, "out\n", "err\n")
    assert done.args[0] == sys.executable


def test_a_failing_process_raises_with_the_end_of_its_stderr():
    with pytest.raises(RuntimeError, match=r"(?s)exited with status 3.*the rank said why"):
        launch(["-c", "import sys; print('the rank said why', file=sys.stderr); sys.exit(3)"])


def test_a_failed_torchrun_names_the_rank_that_raised_first(tmp_path):
    """torchrun's own summary fills the end of stderr, and the other rank reports only a broken connection: the
    reason (here, rank 1's ValueError) was often cut from the message."""
    script = tmp_path / "fails.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise ValueError('the real cause')\n"
        "time.sleep(2)\n"
        "raise ConnectionError('Connection closed by peer')\n",
        encoding="utf-8",
    )
    with pytest.raises(RuntimeError, match=r"exited with status 1; a rank raised ValueError: the real cause;"):
        launch([str(script)], 2, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)


@pytest.mark.parametrize("nproc", [-1, 1.5, "2"])
def test_launch_refuses_a_bad_nproc(nproc):
    with pytest.raises(ValueError, match="nproc must be 0"):
        launch(["-c", "pass"], nproc)


@posix_only
def test_a_timeout_stops_the_process_and_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="ran past 3 s"):
        launch(["-c", PARENT, pid_file], timeout=3)
    assert time.monotonic() - start < 60
    assert _gone(_child_pid(pid_file)), "the child outlived launch's timeout"


@posix_only
def test_an_interrupt_stops_the_process_and_its_children(tmp_path):
    """What a notebook's stop button does: KeyboardInterrupt in the caller, while it waits."""
    pid_file = tmp_path / "child.pid"

    def interrupt_once_started():
        _child_pid(pid_file)
        # to the main thread, which waits for the process: a signal sent to the process may be taken by another
        # thread, and then the main thread sleeps on in its wait until the timeout
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # Python raises KeyboardInterrupt on SIGINT only if it started with SIGINT's default action; a shell's
    # background job (`pytest ... &`) starts with SIGINT ignored, and there this test failed at its timeout.
    # A notebook's kernel handles SIGINT by raising KeyboardInterrupt, as this handler does.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Thread(target=interrupt_once_started, daemon=True)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(["-c", PARENT, pid_file], timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    timer.join(timeout=30)
    assert _gone(_child_pid(pid_file)), "the child outlived the interrupt"


def test_torchrun_on_windows_is_told_to_skip_libuv(monkeypatch):
    """torch's Windows builds have no libuv, and torchrun's rendezvous asks for it unless USE_LIBUV=0."""
    seen = {}

    class Finished:
        returncode, pid = 0, 0

        def communicate(self, timeout=None):
            return "", ""

    def fake_popen(cmd, env=None, **kwargs):
        seen["env"] = env
        return Finished()

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(subprocess, "Popen", fake_popen)
    launch(["-c", "pass"], nproc=2)
    assert seen["env"]["USE_LIBUV"] == "0" and seen["env"]["PATH"] == os.environ["PATH"]
    launch(["-c", "pass"], nproc=0)  # a plain process has no rendezvous: its environment is left as given
    assert seen["env"] is None


def test_without_process_groups_the_process_itself_is_stopped(monkeypatch):
    """Where os.killpg does not exist (Windows), launch signals the process it started."""
    monkeypatch.delattr(os, "killpg", raising=False)  # already absent on Windows
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="ran past 2 s"):
        launch(["-c", "import time; time.sleep(120)"], timeout=2)
    assert time.monotonic() - start < 30


def test_on_windows_the_ranks_are_stopped_with_their_launcher(monkeypatch):
    """Windows has no process groups: terminating torchrun alone left its ranks running; taskkill /T ends the tree."""
    from edurl.llm import distributed

    ran = []

    class Proc:
        pid = 4242

        def wait(self, timeout=None):
            ran.append("wait")

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: ran.append(cmd))
    distributed._stop(Proc(), own_group=False)
    assert ran == [["taskkill", "/F", "/T", "/PID", "4242"], "wait"]

    def no_taskkill(cmd, **kw):
        raise FileNotFoundError("taskkill")

    class Launcher(Proc):  # without taskkill, the launcher itself is still stopped
        def send_signal(self, sig):
            ran.append(sig)

    ran.clear()
    monkeypatch.setattr(subprocess, "run", no_taskkill)
    distributed._stop(Launcher(), own_group=False)
    assert ran == [signal.SIGTERM, "wait"]


def test_the_reason_named_is_the_outermost_exception_of_the_first_rank_to_fail():
    """A chained traceback prints its cause first: the rank's own explanation is the last exception line."""
    from edurl.llm.distributed import _first_rank_error

    stderr = (
        "[rank1]: Traceback (most recent call last):\n[rank1]: KeyError: 'reward'\n"
        "[rank1]: The above exception was the direct cause of the following exception:\n"
        "[rank1]: ValueError: reward_fn returned no 'reward'\n"
        "[rank0]: torch.distributed.DistBackendError: Connection closed by peer\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    )
    assert _first_rank_error(stderr) == "; rank 1 raised ValueError: reward_fn returned no 'reward'"
    assert _first_rank_error("[rank0]: Exception: plain\n") == "; rank 0 raised Exception: plain"
    assert _first_rank_error("nothing raised here\n") == ""
