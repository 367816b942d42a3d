"""Small utilities every chapter uses: picking a device and seeding every RNG.

Chapter 1 introduces both; notebooks call them in their first cell.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import random
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from edurl._checks import is_whole

__all__ = ["device", "seed_everything", "cpu_threads", "torch_threads", "keep_freed_memory"]

_DEVICE_RE = re.compile(r"^(cpu|mps|cuda)(:\d+)?$")


def device(name: str | None = None) -> torch.device:
    """Return the torch device the course should run on.

    Order of precedence: the ``name`` argument, then the ``EDURL_DEVICE``
    environment variable, then CUDA if ``torch.cuda.is_available()``, else CPU.

    Accepted names are ``"cpu"``, ``"cuda"``, ``"cuda:N"`` and ``"mps"``. A name
    that is not one of these, or that names hardware this machine lacks, raises
    ``ValueError`` with the fix, rather than failing later inside a kernel.
    """
    source = "device()"
    if isinstance(name, torch.device):  # what .device gives, e.g. device(model.device)
        name = str(name)
    if name is None:
        name = os.environ.get("EDURL_DEVICE", "").strip() or None
        source = "EDURL_DEVICE"
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    if not isinstance(name, str) or not _DEVICE_RE.match(name.strip().lower()):
        raise ValueError(
            f"{source}: unknown device {name!r}. Use 'cpu', 'cuda', 'cuda:N' or 'mps' "
            "(or leave it unset to pick CUDA when available, else CPU)."
        )
    name = name.strip().lower()
    kind, _, index = name.partition(":")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{source} asks for {name!r}, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}). Use 'cpu', or install a CUDA build of torch on a GPU machine."
            )
        count = torch.cuda.device_count()
        if index and int(index) >= count:
            raise ValueError(
                f"{source} asks for {name!r}, but this machine has {count} CUDA device(s): "
                f"use cuda:0 to cuda:{count - 1}."
            )
    if kind == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError(f"{source} asks for 'mps', but the MPS backend is not available here. Use 'cpu'.")
    if kind == "cpu" and index:
        raise ValueError(f"{source}: {name!r} is not a device; write 'cpu' without an index.")
    return torch.device(name)


# decorators' frames (no_grad), and dataclasses.replace, which remakes a config (the library's loops do) and so
# runs its __post_init__ checks again: the warning goes to the code that called replace, or past edurl's own
_WRAPPERS = ("contextlib.py", os.path.join("torch", "utils", "_contextlib.py"), os.sep + "dataclasses.py")
_LAUNCHERS = ("runpy", "threading.py", os.path.join("multiprocessing", "process.py"))  # no learner's call above


def _generated_init_of_ours(frame) -> bool:
    """Whether ``frame`` is the ``__init__`` that ``dataclasses`` generated (its code has no file) for an edurl class."""
    if frame.f_code.co_filename != "<string>" or frame.f_code.co_name != "__init__":
        return False
    return type(frame.f_locals.get("self")).__module__.partition(".")[0] == "edurl"


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message)`` pointed at the learner's own call, however deep in the library the check runs
    (``stacklevel`` would have to count the frames of every caller): the first frame outside the edurl package and
    the decorators' wrappers around its functions (``torch.no_grad``) and the ``__init__`` that ``dataclasses``
    writes for its configs (``SFTConfig(...)`` warning from ``__post_init__``). Where no learner's code called it
    (``python -m edurl.recipes...``, the sampler's thread or process), it points at the outermost edurl frame."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level, inside = sys._getframe(1), 1, 1
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if name.startswith(package) or _generated_init_of_ours(frame):
            inside = level
        elif not name.endswith(_WRAPPERS):
            break
        frame, level = frame.f_back, level + 1
    if frame is None or any(part in frame.f_code.co_filename for part in _LAUNCHERS):
        level = inside
    warnings.warn(message, category, stacklevel=level + 1)


def file_in_the_way(folder) -> str | None:
    """Why no folder can be made at ``folder``, or None if one can: it is a file, or it lies under a file
    (``mkdir(parents=True)`` ends there in a bare ``NotADirectoryError``). The reason names the file, e.g.
    ``"'notes.txt/run' lies under 'notes.txt', which is a file"``."""
    path = Path(folder)
    for above in (path, *path.parents):
        if above.exists():
            if above.is_dir():
                return None
            if above == path:
                return f"{str(path)!r} is a file"
            return f"{str(path)!r} lies under {str(above)!r}, which is a file"
    return None


def seed_everything(seed: int, *, deterministic: bool | None = None) -> int:
    """Seed Python's ``random``, NumPy's global RNG and torch (CPU and every CUDA device).

    With ``deterministic=True`` torch is also asked for deterministic kernels,
    which makes GPU runs repeatable at some cost in speed; ``False`` asks for them no more; ``None`` (the
    default, and what the trainers pass) leaves the setting as it is, so ``seed_everything(0,
    deterministic=True)`` before ``train_ppo`` stays in force through it. Returns the seed.
    Gymnasium environments take their own seed through ``env.reset(seed=...)``.
    """
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True, False or None, got {deterministic!r}.")
    if not is_whole(seed):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}.")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}. NumPy's legacy RNG accepts no other range.")
    seed = int(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    os.environ["PYTHONHASHSEED"] = str(seed)  # for subprocesses; this process's hash seed is fixed at start
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        if "CUBLAS_WORKSPACE_CONFIG" not in os.environ and torch.cuda.is_available() and torch.cuda.is_initialized():
            warn_at_caller(
                "seed_everything(deterministic=True) after CUDA started: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when "
                "it starts, so its matrix products may still differ between runs. Call seed_everything first, or "
                "export CUBLAS_WORKSPACE_CONFIG=:4096:8 before starting Python.",
            )
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    elif deterministic is False:  # a True from an earlier call stayed in force after seed_everything(s, False)
        torch.use_deterministic_algorithms(False)
    return seed


_pick_device = device  # torch_threads' own argument is called device


MAX_THREADS_ENV = "EDURL_MAX_THREADS"


def usable_cpus() -> frozenset[int]:
    """The ids of the CPUs this process may run on: its CPU affinity where the OS keeps one (Linux: ``taskset``,
    a container's or a Slurm job's cpuset), else every CPU :func:`os.cpu_count` counts."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many CPU cores this process may run on (:func:`usable_cpus`). ``os.cpu_count()`` counts the whole
    machine, so inside a 2-core cpuset on a 64-core host it says 64, and thread counts made from it oversubscribe
    the 2. A CPU quota (``docker --cpus``) is not an affinity, and is not seen here."""
    return max(1, len(usable_cpus()))


def cpu_threads(num_threads: int) -> int:
    """``num_threads``, or ``$EDURL_MAX_THREADS`` when that is set and smaller.

    Two processes that each ask for as many torch threads as the machine has cores fight for them:
    on a 2-core machine, notebooks 07 and 08 at 2 threads each ran about 15 times slower than either
    alone. ``make test`` runs two notebooks at once, so it sets the cap to cores / workers. Every thread
    count the library sets (:func:`torch_threads`, the notebooks' first cell) goes through here.
    """
    if not is_whole(num_threads) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive int, got {num_threads!r}.")
    num_threads = int(num_threads)  # a NumPy int too
    raw = os.environ.get(MAX_THREADS_ENV)
    if raw is None or raw == "":
        return num_threads
    try:
        cap = int(raw)
    except ValueError:
        cap = 0
    if cap < 1:
        raise ValueError(
            f"{MAX_THREADS_ENV}={raw!r} is not a positive whole number of threads. "
            f"Set it to e.g. 1, or unset it to let each config choose."
        )
    return min(num_threads, cap)


@contextlib.contextmanager
def torch_threads(num_threads: int | None, device: str | torch.device | None = "cpu"):
    """Run the block with ``torch.set_num_threads(num_threads)``, then restore the previous setting.

    The course's small MLPs run fastest on one CPU thread, and a fixed thread count makes CPU runs
    repeat exactly on machines with different core counts (floating-point sums depend on how the
    work is split). ``None`` leaves torch's setting alone, and so does a ``device`` that is not the CPU
    (``device=None`` means :func:`device`'s pick): every trainer's config passes its ``num_threads`` and
    ``device`` fields here. ``$EDURL_MAX_THREADS`` caps the count (see :func:`cpu_threads`).
    """
    if isinstance(device, torch.device):
        device = str(device)  # device() takes names
    if num_threads is None or (device != "cpu" and _pick_device(device).type != "cpu"):
        yield
        return
    if not is_whole(num_threads) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}.")
    previous = torch.get_num_threads()
    torch.set_num_threads(cpu_threads(num_threads))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# glibc's mallopt parameters (malloc.h) and the values keep_freed_memory pins them at
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES, _TRIM_THRESHOLD_BYTES = 32 << 20, 64 << 20
_heap_kept = False


def keep_freed_memory() -> bool:
    """Let this process keep memory it frees, for its next tensors, instead of handing it back to the OS at
    once (glibc only; every seed stack, ``edurl.rl.seed_stack.ActorCriticStack``, calls it when built). Returns
    whether it applied.

    A seed stack's activations are (S, batch, 64) tensors, 512 KiB each at 8 seeds, allocated and freed
    dozens of times per optimizer step. glibc's malloc returns the free top of its heap to the OS once it
    passes a threshold, and the next allocations fault the same pages back in, each one zeroed by the kernel.
    In an 8-seed PPO run on CartPole (1 thread) that was 1.2 million page faults and 2.6 s of system time in
    34 s. This pins glibc's two thresholds at the top of the range its own adaptive rule reaches: blocks up
    to 32 MiB come from the heap (not a fresh ``mmap`` each), and up to 64 MiB of free heap is kept. The
    process's peak memory barely moves (441 against 435 MB in a 40k-step run of the same); nothing numerical
    changes.

    It is set once per process and stays set (glibc has no way to read the old values back). On other
    platforms (macOS, Windows, musl) it does nothing and returns False.
    """
    global _heap_kept
    if _heap_kept:
        return True
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _heap_kept = (
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) == 1
        and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1
    )
    return _heap_kept


def progress(
    iterable=None,
    *,
    total: int | None = None,
    desc: str | None = None,
    disable: bool = False,
    max_redraws: int = 100,
    **kwargs,
):
    """A tqdm progress bar (a widget in Jupyter) that redraws at most about ``max_redraws`` times, and
    at most once a second.

    A kernel keeps at most 1000 unread output messages and silently drops the rest, the cell's end
    included. Jupyter reads them as they come, but a test harness such as nbval reads a cell's output
    only after the cell has run. A bar that redraws on every step of a long loop (a few messages per
    redraw) can pass that limit, and the harness then reports a timeout. Pass ``refresh=False`` to
    ``set_postfix`` so that it waits for the next redraw too.

    Iterate it (``for step in progress(range(n))``), or count by hand as the classic-RL trainers do
    (``bar = progress(total=total_steps)``, then ``bar.update(batch_size)`` per update).
    """
    from tqdm.auto import tqdm

    if not is_whole(max_redraws) or max_redraws < 1:
        raise ValueError(f"max_redraws must be a whole number >= 1, got {max_redraws!r}; pass disable=True for no bar.")
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    steps = max(1, (total or 0) - kwargs.get("initial", 0))
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        disable=disable,
        mininterval=1.0,
        maxinterval=float("inf"),
        miniters=max(1, steps // max_redraws),
        **kwargs,
    )
