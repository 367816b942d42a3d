import io
import itertools
import os
import platform
import random
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from tqdm import tqdm

import edurl
from edurl.utils import progress, usable_cores


def test_device_defaults_to_cuda_if_available_else_cpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert edurl.device().type == expected


def test_device_env_override(monkeypatch):
    monkeypatch.setenv("EDURL_DEVICE", "cpu")
    assert edurl.device() == torch.device("cpu")
    monkeypatch.setenv("EDURL_DEVICE", "  CPU ")  # case and spaces forgiven
    assert edurl.device() == torch.device("cpu")


def test_device_argument_beats_env(monkeypatch):
    monkeypatch.setenv("EDURL_DEVICE", "tpu")
    assert edurl.device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("bad", ["tpu", "gpu", "cuda:x", "", "cpu:0"])
def test_unknown_device_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="device|cpu"):
        edurl.device(bad)


def test_unknown_device_from_env_names_the_variable(monkeypatch):
    monkeypatch.setenv("EDURL_DEVICE", "tpu")
    with pytest.raises(ValueError, match="EDURL_DEVICE: unknown device 'tpu'"):
        edurl.device()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_gpu_says_so():
    with pytest.raises(ValueError, match="torch.cuda.is_available\\(\\) is False"):
        edurl.device("cuda")


@pytest.mark.cuda
def test_cuda_device_works():
    dev = edurl.device("cuda")
    assert dev.type == "cuda"
    assert torch.ones(2, device=dev).sum().item() == 2.0
    with pytest.raises(ValueError, match="CUDA device"):
        edurl.device(f"cuda:{torch.cuda.device_count()}")


def test_seed_everything_repeats_python_numpy_and_torch():
    def draw():
        return random.random(), np.random.rand(), torch.rand(1).item()

    edurl.seed_everything(123)
    first = draw()
    edurl.seed_everything(123)
    assert draw() == first
    edurl.seed_everything(124)
    assert draw() != first


def test_deterministic_seeding_after_cuda_started_says_cublas_may_not_listen(monkeypatch):
    """cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it starts: set later, the promise of repeatable GPU runs is empty."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        with pytest.warns(UserWarning, match="CUBLAS_WORKSPACE_CONFIG=:4096:8 before starting Python"):
            edurl.seed_everything(0, deterministic=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            edurl.seed_everything(0, deterministic=True)  # now set: nothing to say
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            edurl.seed_everything(0, deterministic=True)  # before CUDA starts: in time
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(
    "bad, err", [(-1, ValueError), (2**32, ValueError), (1.5, TypeError), ("7", TypeError), (True, TypeError)]
)
def test_seed_everything_rejects_bad_seeds(bad, err):
    with pytest.raises(err, match="seed"):
        edurl.seed_everything(bad)


def test_torch_threads_sets_and_restores():
    before = torch.get_num_threads()
    with edurl.torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with edurl.torch_threads(None):
        assert torch.get_num_threads() == before
    with edurl.torch_threads(1, torch.device("cpu")):  # a torch.device, as its type says (it once raised)
        assert torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="num_threads"):
        with edurl.torch_threads(0):
            pass


def test_max_threads_caps_every_thread_count(monkeypatch):
    # Two notebooks at 2 threads each on a 2-core machine ran 15x slower than one alone; the harness caps them.
    monkeypatch.setenv("EDURL_MAX_THREADS", "1")
    assert edurl.cpu_threads(2) == 1
    assert edurl.cpu_threads(1) == 1
    with edurl.torch_threads(2):
        assert torch.get_num_threads() == 1
    monkeypatch.setenv("EDURL_MAX_THREADS", "8")
    assert edurl.cpu_threads(2) == 2
    monkeypatch.delenv("EDURL_MAX_THREADS")
    assert edurl.cpu_threads(3) == 3


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_max_threads_rejects_bad_values(monkeypatch, bad):
    monkeypatch.setenv("EDURL_MAX_THREADS", bad)
    with pytest.raises(ValueError, match="EDURL_MAX_THREADS"):
        edurl.cpu_threads(2)


def _redraws(make, **kw) -> int:
    buf = io.StringIO()
    bar = make(file=buf, **kw)
    clock = itertools.count(bar.last_print_t, 2.0)  # every step takes 2 s: the time limit never holds a redraw back
    bar._time = lambda: next(clock)
    for _ in bar:
        pass
    bar.close()
    return buf.getvalue().count("\r")


def test_progress_bar_redraws_at_most_about_max_redraws_times():
    # a kernel drops output messages past 1000 unread ones; nbval reads a cell's messages only at its end
    assert 90 <= _redraws(progress, iterable=range(1000)) <= 110
    assert _redraws(progress, iterable=range(1000), max_redraws=10) <= 12
    assert _redraws(progress, iterable=range(40)) >= 40  # short loops redraw every step
    assert _redraws(tqdm, iterable=range(1000), mininterval=1.0) > 900  # what a plain bar does
    resumed = progress(range(900, 1000), total=1000, initial=900, file=io.StringIO())
    assert resumed.miniters == 1
    resumed.close()


def test_progress_bar_counting_with_total_and_update_n():
    # the classic-RL trainers' usage: no iterable, total= env steps, update(n) per batch, postfix without refresh
    buf = io.StringIO()
    bar = progress(total=64 * 1000, file=buf)
    clock = itertools.count(bar.last_print_t, 2.0)
    bar._time = lambda: next(clock)
    for _ in range(1000):
        bar.update(64)
        bar.set_postfix(mean_return="20", refresh=False)
    bar.close()
    assert bar.n == 64 * 1000 and "mean_return=20" in buf.getvalue()  # the postfix shows on the next redraw
    assert 90 <= buf.getvalue().count("\r") <= 110


_FAULTS_SCRIPT = """
import resource, sys, torch
from edurl.utils import keep_freed_memory
torch.set_num_threads(1)  # one thread allocates, from glibc's main arena
if sys.argv[1] == "keep":
    assert keep_freed_memory()
x = torch.ones(8, 256, 64)  # a seed stack's activation at 8 seeds: 512 KiB
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    ys = [x * 2.0 for _ in range(16)]; del ys
before = faults()
for _ in range(20):
    ys = [x * 2.0 for _ in range(16)]; del ys  # 8 MiB live, then freed
print((faults() - before) / 20)
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="keep_freed_memory acts on glibc's malloc only",
)
def test_keep_freed_memory_stops_the_page_faults_of_reallocated_activations():
    """A round that allocates and frees 8 MiB of 512 KiB tensors touches 2,048 pages. By default glibc hands
    them back to the OS after each round and faults them in again; after keep_freed_memory they stay."""

    def faults_per_round(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])

    # the cost it removes: with glibc's defaults the pages come back every round, in most runs (in about one
    # run in ten on a loaded machine the heap is laid out so that nothing is handed back: hence the most of 5)
    assert max(faults_per_round("default") for _ in range(5)) > 1000
    assert faults_per_round("keep") < 50


@pytest.mark.parametrize("trainer", ["ppo", "a2c", "reinforce"])
def test_seed_stack_trainers_keep_freed_memory(monkeypatch, trainer):
    from edurl import rl
    from edurl.rl import seed_stack

    calls = []
    monkeypatch.setattr(seed_stack, "keep_freed_memory", lambda: calls.append(1) or True)
    kw = dict(seed=0, num_seeds=2, env_backend="torch", device="cpu", progress=False, stop_when_solved=False)
    if trainer == "ppo":
        rl.train_ppo(rl.PPOConfig(total_steps=512, **kw))
    elif trainer == "a2c":
        rl.train_a2c(rl.A2CConfig(total_steps=1024, **kw))
    else:
        rl.train_reinforce(rl.ReinforceConfig(max_episodes=16, **kw))
    assert calls == [1]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is a Linux call")
def test_usable_cores_counts_the_cores_this_process_may_run_on():
    """os.cpu_count() counts the machine: a process pinned to one core (taskset, a container's cpuset) still got
    the machine's count, and thread counts made from it oversubscribed that core."""
    allowed = os.sched_getaffinity(0)
    assert usable_cores() == len(allowed)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        assert usable_cores() == 1
    finally:
        os.sched_setaffinity(0, allowed)


@pytest.mark.parametrize("preset", [None, "3"])
def test_xdist_workers_get_cores_over_workers_threads_unless_set(preset):
    """conftest.py caps each pytest-xdist worker (and so each notebook kernel it starts) at cores / workers threads,
    as make test does, and leaves a cap the user set alone."""
    env = {  # as from a shell: this test may itself run in an xdist worker
        k: v
        for k, v in os.environ.items()
        if k not in ("EDURL_MAX_THREADS", "OMP_NUM_THREADS") and not k.startswith("PYTEST_XDIST")
    }
    cores = usable_cores()
    env["PROBE_EXPECT"] = preset or str(max(1, cores // 2))
    if preset:
        env["EDURL_MAX_THREADS"] = preset
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", "tests/_xdist_threads_probe.py"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


def test_warn_at_caller_points_at_the_code_that_called_the_library():
    # a thread whose target is a library function has no learner's call above it: the warning points at the
    # library's outermost frame (it pointed at threading.py); called from here, it points here
    import threading
    import warnings

    from edurl.llm.offline import RolloutBuffer

    one = dict(prompts=[[1, 2]], completions=[[[3], [4]]], logprobs=[[[-0.1], [-0.2]]], rewards=[[1.0, 0.0]])
    known, unknown = (RolloutBuffer(**one, correct=[[1.0, 0.0]], source=["a"], temperature=t) for t in (1.0, None))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        thread = threading.Thread(target=RolloutBuffer.__add__, args=(known, unknown))
        thread.start()
        thread.join()
        known + unknown  # noqa: B018
    assert [w.filename.rsplit("/", 1)[-1] for w in seen] == ["offline.py", "test_utils.py"]


def test_deterministic_false_undoes_true_and_the_default_leaves_it():
    """seed_everything(0, deterministic=False) once left an earlier call's True in force."""
    try:
        edurl.seed_everything(0, deterministic=True)
        edurl.seed_everything(1)  # what the trainers call: the learner's True stays
        assert torch.are_deterministic_algorithms_enabled()
        edurl.seed_everything(2, deterministic=False)
        assert not torch.are_deterministic_algorithms_enabled()
        with pytest.raises(TypeError, match="deterministic must be True, False or None"):
            edurl.seed_everything(0, deterministic="yes")
    finally:
        torch.use_deterministic_algorithms(False)


def test_thread_counts_take_numpy_ints_and_name_a_bad_count_under_the_cap(monkeypatch):
    import numpy as np

    with edurl.torch_threads(np.int64(1)):  # refused: "must be a positive int or None, got np.int64(1)"
        assert torch.get_num_threads() == 1
    monkeypatch.delenv("EDURL_MAX_THREADS", raising=False)  # the xdist runs set a cap of 1
    assert edurl.cpu_threads(np.int32(3)) == 3
    monkeypatch.setenv("EDURL_MAX_THREADS", "2")
    assert edurl.cpu_threads(np.int64(3)) == 2 and type(edurl.cpu_threads(np.int64(3))) is int
    for bad in (None, 0, -3, True, 1.5):  # None was a TypeError from min(), 0 and -3 went through as counts
        with pytest.raises(ValueError, match="num_threads must be a positive int"):
            edurl.cpu_threads(bad)


def test_device_takes_a_torch_device_and_progress_names_a_bad_redraw_count():
    assert edurl.device(torch.device("cpu")) == torch.device("cpu")  # "unknown device device(type='cpu')"
    for bad in (0, -1, True):  # 0 was a ZeroDivisionError
        with pytest.raises(ValueError, match="max_redraws must be a whole number >= 1"):
            progress(range(3), max_redraws=bad, file=io.StringIO())
