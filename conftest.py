# Keeps the outputs of nbval's notebook runs for the book (see book/nbcapture.py).
import os

pytest_plugins = ["book.nbcapture"]


def pytest_configure(config):
    """Under pytest-xdist, give each worker cores / workers torch threads, as ``make test`` does, unless
    ``EDURL_MAX_THREADS`` is set. Without the cap, a hand-typed ``pytest -n 2 notebooks`` ran two kernels that each
    took every core (cells ran many times slower, past nbval's cell timeout), and each warm start was looked up in
    the cache under the uncapped thread count (``edurl.llm.sft.checkpoint_key``), so missed it and trained again.
    The notebooks' kernels inherit this environment."""
    worker = getattr(config, "workerinput", None)  # set in xdist's workers only (an environment variable would
    if worker is None or os.environ.get("EDURL_MAX_THREADS"):  # leak into a pytest -n started inside a worker)
        return
    workers = worker["workercount"]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = str(max(1, cores // workers))
    os.environ["EDURL_MAX_THREADS"] = threads
    os.environ.setdefault("OMP_NUM_THREADS", threads)
