"""GRPO vs step-matched continued SFT, over seeds: does RL earn its place? (Chapter 7).

For each seed, both arms start from that seed's Chapter 6 SFT checkpoint and are scored by greedy pass@1 on
the same held-out problems:

* **GRPO** is the recipe's default run (``edurl.llm.grpo.train_grpo``): 350 steps of 32 problems x 4 sampled
  completions, graded by the verifier only.
* **continued SFT** (``edurl.llm.sft.continued_sft``) keeps everything GRPO's training half uses (the same
  trainer, Adam at the same constant learning rate, 350 optimizer steps of 128 sequences, token-mean
  aggregation) but trains on fresh problems *with their right answers*, and samples nothing.

So the two arms take the same optimizer steps on batches of the same size: step- and batch-matched, not
compute-matched. SFT runs all 128 sequences of a step forward and backward; GRPO samples its 128 first, and its
training half skips the sequences whose advantage is zero (a group that got one reward throughout), so its
gradient compute is smaller and its sampling is extra. Continued SFT needs a dataset of answers; GRPO needs only
a verifier. The table also checks Chapter 7's learning target: GRPO gains >= 30 points of held-out pass@1 in
every seed within a minute of training (the steps' wall time, ``time/step``, evaluations left out; until
2026-12-01 ``time/sample`` + ``time/train``, which missed the sampler's snapshot, about 2-3 % of a step) on 2
cores, judged at the last evaluation (every 25 steps) within that minute, whether or not the run goes on past it.

    python benchmarks/grpo_vs_sft.py                  # seeds 0,1,2, 350 steps each (about 8 minutes)
    python benchmarks/grpo_vs_sft.py --smoke          # 3 steps, seed 0, a 30-step warm start: does it run end to end?
    python benchmarks/grpo_vs_sft.py --check          # exit 1 unless GRPO gains >= 30 points within 60 s, every seed
    python benchmarks/grpo_vs_sft.py --grpo-only --seeds 0,1,2,3,4,5,6,7,8,9   # the learning target over more seeds
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from _args import positive_int, seed_list  # benchmarks/ is on sys.path when a script runs
from grpo_variants import gains_within, learning_curve  # noqa: E402  (benchmarks/ is on sys.path)

from edurl.llm.grpo import GRPOConfig, train_grpo  # noqa: E402
from edurl.llm.sft import continued_sft  # noqa: E402

TARGET_GAIN = 0.30
TARGET_SECONDS = 60


def run(arm: str, config: GRPOConfig) -> tuple[dict, pd.DataFrame]:
    t0 = time.perf_counter()
    result = train_grpo(config) if arm == "GRPO" else continued_sft(config)
    seconds = time.perf_counter() - t0
    m = result.metrics
    train_s = float(m["time/step"].sum())  # each step's wall time, the sampler's snapshot included, evaluations not
    row = {
        "seed": config.seed,
        "arm": arm,
        "start": result.start.pass_at_1,
        "after": result.final.pass_at_1,
        "gain": result.final.pass_at_1 - result.start.pass_at_1,
        "format": result.final.format,
        "train s": train_s,
        "total s": seconds,
    }
    if arm == "GRPO":  # the target's measure: the gain at the last evaluation within TARGET_SECONDS of training
        row[f"gain by {TARGET_SECONDS} s"] = gains_within(
            [{"start": result.start.pass_at_1, **learning_curve(result)}], TARGET_SECONDS
        )[0]
    curve = m.dropna(subset=["test/pass_at_1"])[["step", "test/pass_at_1"]].assign(seed=config.seed, arm=arm)
    start = pd.DataFrame(
        {"step": [-1], "test/pass_at_1": [result.start.pass_at_1], "seed": [config.seed], "arm": [arm]}
    )
    return row, pd.concat([start, curve])


def plot(curves: pd.DataFrame, path: Path) -> None:
    seeds = sorted(curves["seed"].unique())
    fig, axes = plt.subplots(1, len(seeds), figsize=(4 * len(seeds), 3), sharey=True, squeeze=False)
    for ax, seed in zip(axes[0], seeds):
        for arm, style in (("GRPO", "-"), ("continued SFT", "--")):
            c = curves[(curves["seed"] == seed) & (curves["arm"] == arm)]
            if c.empty:  # --grpo-only
                continue
            ax.plot(c["step"] + 1, c["test/pass_at_1"], style, marker=".", label=arm)
        ax.set(title=f"seed {seed}", xlabel="optimizer steps")
    axes[0][0].set_ylabel("held-out pass@1 (greedy)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=seed_list, default=None, help="comma-separated seeds (default 0,1,2)")
    ap.add_argument(
        "--steps", type=positive_int, default=None, help=f"optimizer steps per arm (default {GRPOConfig.max_steps})"
    )
    ap.add_argument(
        "--out",
        default=None,
        help="metrics of every run and grpo_vs_sft.png go here (default runs/grpo_vs_sft; runs/grpo_vs_sft_smoke with "
        "--smoke, so that a smoke run never replaces a full one)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="3 steps, seed 0, from a warm start of 30 SFT steps (not the course's cached checkpoint, which a "
        "fresh machine would first train for minutes): a quick end-to-end check (no --seeds, --steps or --check)",
    )
    ap.add_argument(
        "--grpo-only", action="store_true", help="run the GRPO arm alone (the learning target, no baseline)"
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 unless GRPO gains >= {TARGET_GAIN * 100:.0f} points within {TARGET_SECONDS} s of training in every seed",
    )
    args = ap.parse_args()
    if args.smoke and (args.check or args.seeds is not None or args.steps is not None):
        ap.error(
            "--smoke runs 3 steps of seed 0 to see that the script runs end to end; it takes no --seeds or --steps, "
            "and 3 steps cannot meet --check's target"
        )
    seeds = [0] if args.smoke else args.seeds or [0, 1, 2]
    steps = 3 if args.smoke else args.steps or GRPOConfig.max_steps
    out = Path(args.out or ("runs/grpo_vs_sft_smoke" if args.smoke else "runs/grpo_vs_sft"))

    rows, curves = [], []
    for seed in seeds:
        base = GRPOConfig(seed=seed, max_steps=steps, eval_every=max(1, min(25, steps)))
        if args.smoke:  # a short warm start of its own: the course's takes minutes to train on a fresh machine
            base = replace(base, sft=replace(base.sft, max_steps=30, extra_steps=0, target_pass_at_1=None))
        for arm, name in (("GRPO", "grpo"),) if args.grpo_only else (("GRPO", "grpo"), ("continued SFT", "sft")):
            row, curve = run(arm, replace(base, log_dir=str(out / f"seed{seed}" / name)))
            rows.append(row)
            curves.append(curve)
            print(
                f"seed {seed} {arm:>13}: held-out pass@1 {row['start']:.1%} -> {row['after']:.1%} "
                f"({row['gain']:+.1%}) in {row['train s']:.0f} s of training",
                flush=True,
            )

    df = pd.DataFrame(rows).set_index(["seed", "arm"])
    print(
        f"\n2-digit addition from each seed's SFT checkpoint; {steps} optimizer steps of "
        f"{GRPOConfig.batch_size * GRPOConfig.group_size} sequences per arm, "
        f"lr {GRPOConfig.learning_rate:g}, greedy pass@1 on {GRPOConfig.num_eval} held-out problems"
    )
    print(df.to_string(float_format=lambda x: f"{x:,.3f}"))
    grpo = df.xs("GRPO", level="arm")
    if args.grpo_only:
        side = grpo[["gain", f"gain by {TARGET_SECONDS} s", "train s"]].rename(columns={"gain": "GRPO gain"})
    else:
        sft = df.xs("continued SFT", level="arm")
        side = pd.DataFrame(
            {
                "GRPO gain": grpo["gain"],
                "SFT gain": sft["gain"],
                "GRPO - SFT": grpo["gain"] - sft["gain"],
                "train s (GRPO / SFT)": grpo["train s"] / sft["train s"],
            }
        )
    if len(seeds) > 1:
        side.loc["median"] = side.median()
        side.loc["min"], side.loc["max"] = side.iloc[:-1].min(), side.iloc[:-1].max()
    print("\n" + side.to_string(float_format=lambda x: f"{x:,.3f}"))
    ok = grpo[f"gain by {TARGET_SECONDS} s"] >= TARGET_GAIN
    print(
        f"\nGRPO gained >= {TARGET_GAIN:.0%} by its last evaluation within {TARGET_SECONDS} s of training in "
        f"{int(ok.sum())} of {len(ok)} seeds (and within its whole run, if that took no longer, in "
        f"{int((ok & (grpo['train s'] <= TARGET_SECONDS)).sum())})"
    )
    out.mkdir(parents=True, exist_ok=True)
    plot(pd.concat(curves), out / "grpo_vs_sft.png")
    print(f"learning curves: {out / 'grpo_vs_sft.png'}")
    if args.check and not ok.all():
        sys.exit(1)


if __name__ == "__main__":
    main()
