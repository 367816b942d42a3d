"""GRPO recipe variants over seeds: held-out pass@1 against steps (Chapter 7, "Why not a higher learning rate?").

Each run is ``train_grpo`` from a seed's Chapter 6 warm start with the recipe's defaults and one change:

* ``default``: the recipe (32 problems x 4 completions, importance sampling, token-mean, Adam 3e-4, advantages
  centred per group, no std);
* ``g8``: 32 problems x 8 completions, the recipe until Chapter 7 moved to 4;
* ``p16``: 16 problems x 8 completions, the same 128 sequences a step as the recipe, from half as many problems;
* ``std``, ``lr6e-4`` and ``lr1e-3``, studied at 32 x 8 (Chapter 7's table): ``advantage_scale="group"``,
  GRPO's division of each group's advantages by its standard deviation, and Adam at 2x and 3.3x the recipe's
  learning rate.

Held-out pass@1 (greedy, 200 test problems) is measured every 25 steps, with the training seconds so far
(the steps' wall time, ``time/step``: evaluations left out), so the report also compares the variants per second.
Each run appends one JSON line to ``--out`` and claims its (variant, seed) first, so one process per core can
share the work:

    python benchmarks/grpo_variants.py --variants default,std,lr1e-3 --seeds 0,1,2,3 --steps 150 --out F &
    python benchmarks/grpo_variants.py --variants default,std,lr1e-3 --seeds 0,1,2,3 --steps 150 --out F &
    python benchmarks/grpo_variants.py --report F --plot variants.png   # the table, and the curves

Runs are deterministic on one machine and thread count, so a run of 300 steps repeats a run of 150 for its first
150. ``--threads`` (default 1) is the torch thread count of the warm start and of GRPO.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _args import seed_list  # benchmarks/ is on sys.path when a script runs

VARIANTS = {
    "default": {},
    "g8": {"group_size": 8},
    "p16": {"batch_size": 16, "group_size": 8},
    "std": {"group_size": 8, "advantage_scale": "group"},
    "lr6e-4": {"group_size": 8, "learning_rate": 6e-4},
    "lr1e-3": {"group_size": 8, "learning_rate": 1e-3},
}
REPORT_STEPS = (50, 100, 150, 200, 300)
GAIN_LINE = 0.15  # the gain the report counts seeds against
BUDGET_SECONDS, BUDGET_GAIN = 60, 0.30  # Chapter 7's per-second target: +30 points within a minute of training


def claim(out: str, *key) -> bool:
    """Create ``out.KEY.claim`` unless it exists: True for the one process that gets to run ``key``."""
    try:
        os.close(os.open(".".join([out, *map(str, key), "claim"]), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def run(variant: str, seed: int, steps: int, threads: int) -> dict:
    from dataclasses import replace

    from edurl.llm import SFTConfig, load_or_train_sft
    from edurl.llm.grpo import GRPOConfig, train_grpo

    t0 = time.perf_counter()
    config = GRPOConfig(
        max_steps=steps,
        seed=seed,
        num_threads=threads,
        sft=SFTConfig(num_threads=threads),
        progress=True,  # the run's own bar, on stderr
        log_dir=tempfile.mkdtemp(prefix="edurl-variants-"),
        **VARIANTS[variant],
    )
    result = train_grpo(config)
    sft_history = load_or_train_sft(replace(config.sft, seed=seed), progress=False)[2]  # cached by train_grpo
    m = result.metrics
    return {
        "variant": variant,
        "seed": seed,
        "threads": threads,
        "start": result.start.pass_at_1,
        "sft_steps": len(sft_history),
        "sft_target_met": sft_history[-1].get("target_met"),
        "final": result.final.pass_at_1,
        "format": result.final.format,
        **learning_curve(result),
        "train_correct_last20": float(m["env/all/correct"].iloc[-20:].mean()),
        "frac_mixed": float(m["env/all/by_group/frac_mixed"].mean()),  # groups with a signal, over the run
        "seconds": round(time.perf_counter() - t0, 1),
    }


def learning_curve(result) -> dict[str, list]:
    """A GRPO run's held-out curve: ``curve``, [updates done, pass@1] from the start (the evaluation after step s,
    0-based, has seen s + 1 updates), and ``curve_seconds``, the training seconds so far at each point
    (the steps' wall time, ``time/step``: evaluations left out; until 2026-12-01 ``time/sample`` + ``time/train``,
    which missed the sampler's snapshot, about 2-3 % of a step)."""
    m = result.metrics
    evals = m.assign(train_s=m["time/step"].cumsum()).dropna(subset=["test/pass_at_1"])
    return {
        "curve": [[0, result.start.pass_at_1]]
        + [[int(s) + 1, float(p)] for s, p in evals[["step", "test/pass_at_1"]].values],
        "curve_seconds": [0.0] + [round(float(t), 2) for t in evals["train_s"]],
    }


def gains_at(rows: list[dict], steps: int) -> list[float]:
    """Each run's held-out gain after ``steps`` updates (runs that did not reach it are left out)."""
    out = []
    for r in rows:
        at = dict((int(s), p) for s, p in r["curve"])
        if steps in at:
            out.append(at[steps] - r["start"])
    return out


def gains_within(rows: list[dict], seconds: float) -> list[float]:
    """Each run's held-out gain at its last evaluation within ``seconds`` of training (the start counts as one, at
    0 s). Runs recorded without their seconds, by an earlier version of this script, are left out."""
    out = []
    for r in rows:
        if "curve_seconds" in r:
            within = [p for (_, p), t in zip(r["curve"], r["curve_seconds"]) if t <= seconds]
            out.append(within[-1] - r["start"])
    return out


def recorded_variants(rows: list[dict]) -> list[str]:
    """The variants that ``rows`` hold runs of, in VARIANTS' order."""
    return [v for v in VARIANTS if any(r["variant"] == v for r in rows)]


def distinct_runs(rows: list[dict]) -> list[dict]:
    """``rows`` with one run per (variant, seed): the longest, where a file holds a run twice. Runs at different
    thread counts are different runs of a chaotic process, so they are refused: report one count at a time."""
    threads = sorted({r.get("threads", 1) for r in rows})
    if len(threads) > 1:
        raise SystemExit(f"these runs used {threads} torch threads; report each thread count's files on their own")
    longest: dict[tuple, dict] = {}
    for r in rows:
        key = (r["variant"], r["seed"])
        if key not in longest or max(r["curve"]) > max(longest[key]["curve"]):
            longest[key] = r
    return list(longest.values())


def report(rows: list[dict]) -> str:
    """Per variant and step count: the held-out gain's median (min to max) over seeds, in points, and how many
    seeds gained at least GAIN_LINE; then one line per seed: its warm start's pass@1 (with its SFT steps, and "missed"
    where it did not reach its validation target) and each variant's last gain."""
    rows = distinct_runs(rows)
    lines = [f"held-out pass@1 gain in points: median (min to max), seeds >= +{GAIN_LINE * 100:.0f} / seeds"]
    header = f"{'variant':10s}" + "".join(f"{f'after {s} steps':>30s}" for s in REPORT_STEPS)
    lines.append(header)
    variants = recorded_variants(rows)
    for variant in variants:
        cells = []
        for s in REPORT_STEPS:
            g = gains_at([r for r in rows if r["variant"] == variant], s)
            if not g:
                cells.append(f"{'-':>30s}")
                continue
            text = f"{statistics.median(g) * 100:+.1f} ({min(g) * 100:+.1f} to {max(g) * 100:+.1f}) {sum(x >= GAIN_LINE for x in g)}/{len(g)}"
            cells.append(f"{text:>30s}")
        lines.append(f"{variant:10s}" + "".join(cells))
    lines += [
        "",
        f"per second: the gain at the last evaluation within {BUDGET_SECONDS} s of training (seeds >= "
        f"+{BUDGET_GAIN * 100:.0f}), the training seconds of the whole run, and its share of mixed groups (rewards "
        "not all equal): median (min to max)",
    ]
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant and "curve_seconds" in r]
        if not mine:
            continue
        g, t = gains_within(mine, BUDGET_SECONDS), [r["curve_seconds"][-1] for r in mine]
        mixed = [r["frac_mixed"] for r in mine if "frac_mixed" in r]
        lines.append(
            f"{variant:10s} {statistics.median(g) * 100:+.1f} ({min(g) * 100:+.1f} to {max(g) * 100:+.1f}) "
            f"{sum(x >= BUDGET_GAIN for x in g)}/{len(g)}   {statistics.median(t):.0f} s ({min(t):.0f} to "
            f"{max(t):.0f}) for {max(max(r['curve'])[0] for r in mine)} steps"
            + (f"   mixed {statistics.median(mixed):.0%} ({min(mixed):.0%} to {max(mixed):.0%})" if mixed else "")
        )
    lines += ["", "per seed: the warm start's held-out pass@1, and each variant's gain after its last step (steps)"]
    lines.append(f"{'seed':>4s} {'warm start':>10s} {'SFT steps':>16s}" + "".join(f"{v:>16s}" for v in variants))
    for seed in sorted({r["seed"] for r in rows}):
        mine = [r for r in rows if r["seed"] == seed]
        cells = []
        for v in variants:
            run = next((r for r in mine if r["variant"] == v), None)
            last = max(run["curve"]) if run else None  # the curve's last (steps, pass@1)
            text = f"{(last[1] - run['start']) * 100:+.1f} ({last[0]})" if run else "-"
            cells.append(f"{text:>16s}")
        sft = str(mine[0].get("sft_steps", "?")) + (" (missed)" if mine[0].get("sft_target_met") is False else "")
        lines.append(f"{seed:>4d} {mine[0]['start']:>10.1%} {sft:>16s}" + "".join(cells))
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for variant in recorded_variants(rows):
        mine = [r for r in rows if r["variant"] == variant]
        steps = sorted({int(s) for r in mine for s, _ in r["curve"]})
        med, lo, hi, xs = [], [], [], []
        for s in steps:
            g = gains_at(mine, s)
            if len(g) == len(mine):  # only steps every seed reached
                xs.append(s)
                med.append(100 * statistics.median(g))
                lo.append(100 * min(g))
                hi.append(100 * max(g))
        (line,) = ax.plot(xs, med, marker=".", label=f"{variant} ({len(mine)} seeds)")
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
    ax.axhline(0, color="gray", lw=1)
    ax.set_xlabel("GRPO steps")
    ax.set_ylabel("held-out pass@1 gain (points)")
    ax.set_title("GRPO variants: median and min-max over seeds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--seeds", type=seed_list, default="0,1,2,3", help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="append each run to this JSON-lines file")
    parser.add_argument("--report", help="comma-separated --out files: print the table, and run nothing")
    parser.add_argument("--plot", help="with --report: save the curves to this image")
    args = parser.parse_args(argv)
    if args.report:
        rows = [
            json.loads(line) for path in args.report.split(",") for line in open(path, encoding="utf-8") if line.strip()
        ]
        print(report(rows))
        if args.plot:
            plot(distinct_runs(rows), args.plot)
        return
    if not args.out:
        parser.error("--out is required to run (or pass --report FILES to read earlier runs)")
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for variant in variants:
            if not claim(args.out, variant, seed, args.steps, args.threads):
                continue
            row = run(variant, seed, args.steps, args.threads)
            print(json.dumps(row), flush=True)
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
