"""What a sampler beside the trainer could buy on this machine: the two halves of a GRPO step, alone and side by side.

A sampler one step ahead (``GRPOConfig(max_steps_off_policy=1)``, Chapter 10) makes a step cost
max(sample, train) instead of sample + train, but only when each half runs as fast beside the other, on its
share of the cores, as the synchronous loop runs it on all of them. On a batch of the recipe's run (seed 0, 32
problems x 8 completions as in ``async_grpo.py``, at step ``--at``), this script times:

* **sync**: the sample half (a fresh sampler, ``grpo.collect``: sample, grade, advantages, datums) and the
  train half (``forward_backward`` with the recipe's loss, gradients then dropped) one after the other, on
  ``--cores`` threads;
* each half **alone** on ``--cores // 2`` threads;
* each half **beside** the other, which runs over and over in a second thread on the other half of the cores;
* with ``--processes``, each half beside the other running in a second *process* (the same recipe state, rebuilt
  there), which shares the cores' caches and memory but not the Python interpreter and its lock (the GIL).

The async loop's steps cost at least the slower half beside the other, so ``sync / max(beside)`` bounds its
speed-up (the optimizer step and the queue add to it). ``sync / max(alone)`` is the bound if the halves did not
slow each other down at all. Chapter 10's target is 1.2x on 2 cores; ``benchmarks/async_grpo.py`` measures the
real loop, whose sampler is a thread.

    python benchmarks/async_budget.py               # about a minute on 2 cores
    python benchmarks/async_budget.py --processes   # also beside a second process (about two minutes)
    python benchmarks/async_budget.py --cores 8     # what a larger machine's split would give
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import threading
import time

from _args import positive_int  # benchmarks/ is on sys.path when a script runs

from edurl.llm import grpo
from edurl.llm.grpo import GRPOConfig, train_grpo
from edurl.utils import torch_threads, usable_cores


def sample_half(config, trainer, renderer, task, step):
    sampler = trainer.save_weights_and_get_sampling_client(f"budget_{step}")
    return grpo.collect(config, sampler, renderer, task, step, renderer.get_stop_sequences())


def train_half(config, trainer, rollout):
    """``grpo.update``'s forward_backward for a one-substep recipe, without the optimizer step (the weights stay)."""
    trainer.forward_backward(
        rollout.datums,
        config.loss_fn,
        config.loss_fn_config(),
        aggregation=config.aggregation,
        max_tokens=config.max_tokens,
        temperature=config.temperature,
    ).result()
    for p in trainer.trainable_parameters():
        p.grad = None


def median_ms(fn, reps: int, threads: int) -> float:
    times = []
    with torch_threads(threads):
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def beside(fn, other, reps: int, threads: int) -> float:
    """``fn``'s median ms while ``other`` runs over and over in a thread of its own, each on ``threads`` threads."""
    stop, started, failed = threading.Event(), threading.Event(), []

    def loop():
        try:
            with torch_threads(threads):  # torch's thread count is set per thread
                while not stop.is_set():
                    other()
                    started.set()
        except BaseException as e:  # handed to the main thread, which would otherwise wait for ever
            failed.append(e)
        finally:
            started.set()

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    started.wait()
    try:
        ms = None if failed else median_ms(fn, reps, threads)
    finally:
        stop.set()
        worker.join()
    if failed:
        raise RuntimeError("the half running beside the timed one failed; its error is above") from failed[0]
    return ms


def at_recipe_step(at: int, cores: int, use) -> GRPOConfig:
    """Run the recipe (seed 0, 32 problems x 8 completions, as ``async_grpo.py`` and the rest of Chapter 10) on
    ``cores`` threads up to step ``at``, and there call ``use(sample, train)`` with that step's two halves."""

    def step_fn(config, trainer, renderer, task, step):
        row, _ = grpo.grpo_step(config, trainer, renderer, task, step, renderer.get_stop_sequences())
        if step == at:
            rollout = sample_half(config, trainer, renderer, task, step)
            use(
                lambda: sample_half(config, trainer, renderer, task, step), lambda: train_half(config, trainer, rollout)
            )
        return row

    with tempfile.TemporaryDirectory(prefix="edurl-async-budget-") as tmp:
        config = GRPOConfig(
            seed=0, group_size=8, max_steps=at + 1, eval_every=10**6, num_threads=cores, progress=False, log_dir=tmp
        )
        train_grpo(config, step_fn=step_fn)
    return config


HALVES = ("sample", "train")


def _half_in_a_loop(which: str, at: int, cores: int, threads: int, ready, stop) -> None:
    """A second process's work for :func:`beside_process`: rebuild the recipe's state at step ``at``, then run
    half ``which`` over and over on ``threads`` threads until ``stop`` is set (``ready`` once it has run once)."""
    if which not in HALVES:
        raise ValueError(f"which must be one of {HALVES}, got {which!r}")

    def use(sample, train):
        fn = sample if which == "sample" else train
        with torch_threads(threads):
            fn()
            ready.set()
            while not stop.is_set():
                fn()

    at_recipe_step(at, cores, use)


def beside_process(fn, other: str, at: int, cores: int, reps: int, threads: int, start_timeout: float = 600) -> float:
    """``fn``'s median ms while half ``other`` of the recipe's step ``at`` runs over and over in a second process
    (started with ``spawn``; it rebuilds the recipe's state first), each on ``threads`` threads."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    worker = ctx.Process(target=_half_in_a_loop, args=(other, at, cores, threads, ready, stop), daemon=True)
    worker.start()
    try:
        waited = 0.0
        while not ready.wait(1.0):
            waited += 1.0
            if not worker.is_alive():
                raise RuntimeError(
                    f"the process running the {other!r} half exited with status {worker.exitcode} before it was "
                    "ready; its error is above"
                )
            if waited > start_timeout:
                raise TimeoutError(f"the process running the {other!r} half was not ready after {start_timeout:.0f} s")
        return median_ms(fn, reps, threads)
    finally:
        stop.set()
        worker.join(timeout=60)
        if worker.is_alive():
            worker.terminate()
            worker.join()


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=positive_int, default=usable_cores(), help="CPU cores the run may use")
    parser.add_argument("--at", type=int, default=5, help="the recipe step whose batch is timed")
    parser.add_argument("--reps", type=positive_int, default=7, help="timed calls per measurement (median)")
    parser.add_argument(
        "--processes", action="store_true", help="also time each half beside the other running in a second process"
    )
    args = parser.parse_args(argv)
    half = max(1, args.cores // 2)
    out: dict[str, float] = {}

    def use(sample, train):
        out["sample, sync"] = median_ms(sample, args.reps, args.cores)
        out["train, sync"] = median_ms(train, args.reps, args.cores)
        out["sample, alone"] = median_ms(sample, args.reps, half)
        out["train, alone"] = median_ms(train, args.reps, half)
        out["sample, beside"] = beside(sample, train, args.reps, half)
        out["train, beside"] = beside(train, sample, args.reps, half)
        if args.processes:
            out["sample, beside a process"] = beside_process(sample, "train", args.at, args.cores, args.reps, half)
            out["train, beside a process"] = beside_process(train, "sample", args.at, args.cores, args.reps, half)

    config = at_recipe_step(args.at, args.cores, use)
    sync = out["sample, sync"] + out["train, sync"]
    columns = ["sync", "alone", "beside"] + (["beside a process"] if args.processes else [])
    print(
        f"GRPO recipe batch ({config.batch_size} problems x {config.group_size} samples) at step {args.at}, "
        f"median of {args.reps} calls; sync on {args.cores} threads, each async half on {half}"
    )
    print(f"{'half':<8}" + "".join(f" {c + ' ms':>20}" for c in columns))
    for name in HALVES:
        print(f"{name:<8}" + "".join(f" {out[f'{name}, {c}']:20.1f}" for c in columns))
    print(f"sync step (sample + train): {sync:.1f} ms")
    bounds = (
        ("beside", "beside the other in a thread"),
        ("beside a process", "beside the other in a process"),
        ("alone", "alone (no contention at all)"),
    )
    for c, what in bounds:
        if c in columns:
            slower = max(out[f"{name}, {c}"] for name in HALVES)
            out[f"bound, {c}"] = sync / slower
            print(f"async step >= the slower half {what}: {slower:.1f} ms; bound on the speed-up {sync / slower:.2f}x")
    print("Chapter 10's target: 1.2x")
    return out


if __name__ == "__main__":
    main()
