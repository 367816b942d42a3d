"""Chapter 10's staleness sweep in full: k = 0, 1, 2, 4, 8 steps stale, with three losses, over seeds.

Each run is notebook 10's GRPO recipe (the default run from the Chapter 6 warm start, 60 steps) with batch s sampled
by the weights of step max(0, s - k). k = 0 is the on-policy run, one per seed, shared by the three losses (on a
fresh batch their gradients are equal). The notebook sweeps k = 0, 2, 8; this script adds 1 and 4. Per (k, loss) it
prints, over seeds, the median (min to max) of held-out pass@1 after 60 steps minus the same seed's on-policy run,
of the mean ``kl_sample_train_v2`` and of the clip fraction, and draws them against k.

The runs come from ``_llm_margins.py`` (about 10 minutes a seed on one core; one such process per core share the
work through claim files)::

    python benchmarks/_llm_margins.py --experiments staleness_sweep --seeds 0,1,2,3 --out sweep.jsonl
    python benchmarks/staleness_sweep.py --load sweep.jsonl --plot runs/staleness_sweep.png
"""

from __future__ import annotations

import argparse
import json
import statistics

import _llm_margins  # benchmarks/ is on sys.path when this script runs

KS = (0, *_llm_margins.SWEEP_KS)


def table(rows: list[dict]) -> list[dict]:
    """One record per (k, loss): the per-seed values of the pass@1 change against the on-policy run, the mean
    kl_sample_train_v2 and the clip fraction."""
    out = []
    for k in KS:
        for loss in _llm_margins.STALE_LOSSES:
            name = "k0" if k == 0 else f"k{k}_{loss}"
            out.append(
                {
                    "k": k,
                    "loss": loss,
                    "pass_change": [r[f"{name}_pass"] - r["k0_pass"] for r in rows],
                    "kl_v2": [r[f"{name}_kl_v2"] for r in rows],
                    "clip": [r[f"{name}_clip"] for r in rows],
                }
            )
    return out


def _cell(values: list[float], scale: float = 1.0, fmt: str = "+.1f") -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):{fmt}} ({min(v):{fmt}} to {max(v):{fmt}})"


def report(rows: list[dict]) -> str:
    records = table(rows)
    start = [r["start_pass"] for r in rows]
    gain = [r["k0_pass"] - r["start_pass"] for r in rows]
    lines = [
        f"{len(rows)} seeds ({', '.join(str(r['seed']) for r in rows)}); median (min to max) over seeds",
        f"warm start held-out pass@1 {_cell(start, 100, '.1f')} %; on-policy gain in 60 steps {_cell(gain, 100)} points",
        f"{'k':>2}  {'loss':<20} {'pass@1 vs on-policy (points)':<30} {'mean kl_sample_train_v2':<30} clip fraction (%; importance_sampling: r outside [0.8, 1.2])",
    ]
    for rec in records:
        if rec["k"] == 0 and rec["loss"] != _llm_margins.STALE_LOSSES[0]:
            continue
        loss = "(on-policy)" if rec["k"] == 0 else rec["loss"]
        lines.append(
            f"{rec['k']:>2}  {loss:<20} {_cell(rec['pass_change'], 100):<30} "
            f"{_cell(rec['kl_v2'], 1, '.3g'):<30} {_cell(rec['clip'], 100, '.2f')}"
        )
    kl = {(r["k"], r["loss"]): r["kl_v2"] for r in records}
    for loss in _llm_margins.STALE_LOSSES:
        rising = sum(all(a < b for a, b in zip(seq, seq[1:])) for seq in zip(*(kl[k, loss] for k in KS)))
        lines.append(f"mean kl_sample_train_v2 rises with every step of k, {loss}: on {rising} of {len(rows)} seeds")
    by = {(r["k"], r["loss"]): r["pass_change"] for r in records}
    lines.append("importance_sampling (no clip) minus the mean of ppo and cispo, pass@1 points:")
    for k in _llm_margins.SWEEP_KS:
        diff = [i - (p + c) / 2 for i, p, c in zip(by[k, "importance_sampling"], by[k, "ppo"], by[k, "cispo"])]
        lines.append(f"  k = {k}: {_cell(diff, 100)}; below on {sum(d < 0 for d in diff)} of {len(diff)} seeds")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = table(rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for loss in _llm_margins.STALE_LOSSES:
        got = [r for r in records if r["loss"] == loss]
        ks = [r["k"] for r in got]
        for ax, key, scale in ((axes[0], "pass_change", 100), (axes[1], "kl_v2", 1)):
            med = [statistics.median(r[key]) * scale for r in got]
            lo = [min(r[key]) * scale for r in got]
            hi = [max(r[key]) * scale for r in got]
            (line,) = ax.plot(ks, med, "o-", label=loss)
            ax.fill_between(ks, lo, hi, color=line.get_color(), alpha=0.12)
    axes[0].axhline(0, color="gray", ls=":")
    axes[0].set(xlabel="k (steps stale)", ylabel="held-out pass@1 minus on-policy (points)")
    axes[1].set(xlabel="k (steps stale)", ylabel="mean kl_sample_train_v2", ylim=(0, None))
    axes[0].legend(fontsize=8)
    fig.suptitle(f"staleness sweep, {len(rows)} seeds: median, band = min to max")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="the JSON-lines file _llm_margins.py --out wrote")
    parser.add_argument("--plot", default=None, help="save the figure here (PNG)")
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.load, encoding="utf-8") if line.strip()]
    rows = sorted((r for r in rows if r["experiment"] == "staleness_sweep"), key=lambda r: r["seed"])
    if not rows:
        raise SystemExit(f"{args.load} has no staleness_sweep rows: run _llm_margins.py --experiments staleness_sweep")
    print(report(rows))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
