"""How much room notebook 07's length-bias asserts have: the notebook's study, rerun over many seeds.

    python benchmarks/length_bias.py              # seeds 0-49, both aggregations: about 15 s on one core
    python benchmarks/length_bias.py --seeds 100

Prints, for each block of 10 seeds (the notebook runs seeds 0-9, the first block), the statistics that
notebook 07 asserts, as multiples of the starting expected length (the same for every seed):

* GRPO (seq_mean_token_mean): the smallest final wrong length and the largest final right length over
  the block's seeds (the notebook asserts >= 2.5x and <= 0.65x on every seed);
* Dr. GRPO (seq_mean_token_sum_norm): the block's median final wrong length (asserted in [0.7, 1.5]x);
* the ratio of the two aggregations' median final wrong lengths (asserted >= 2).

The runs are float64 on the CPU with one thread, so a rerun on any machine gives the same table up to the
last digits of the sampling's log and floor.
"""

from __future__ import annotations

import argparse

import pandas as pd
from _args import seed_count  # benchmarks/ is on sys.path when a script runs

from edurl.llm.length_bias import length_bias_study

MODES = ("seq_mean_token_mean", "seq_mean_token_sum_norm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=seed_count, default=50, help="number of seeds: 0..N-1, in blocks of 10")
    args = parser.parse_args()
    study = length_bias_study(MODES, seeds=range(args.seeds))
    start = study["length/wrong"].iloc[0]
    end = study[study.step == study.step.max()].assign(block=lambda d: d.seed // 10)
    rows = []
    for _, frame in end.groupby("block"):
        grpo, dr = (frame[frame.aggregation == a] for a in MODES)
        rows.append(
            {
                "seeds": f"{grpo.seed.min()}-{grpo.seed.max()}",
                "GRPO wrong, min": grpo["length/wrong"].min() / start,
                "GRPO right, max": grpo["length/right"].max() / start,
                "Dr. GRPO wrong, median": dr["length/wrong"].median() / start,
                "Dr. GRPO wrong, max": dr["length/wrong"].max() / start,
                "GRPO / Dr. GRPO wrong, medians": grpo["length/wrong"].median() / dr["length/wrong"].median(),
            }
        )
    print(f"starting expected length {start:.3f} tokens; final lengths as multiples of it")
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    print(
        "asserted in notebook 07 (seeds 0-9): GRPO wrong >= 2.50 and right <= 0.65 on every seed; "
        "Dr. GRPO wrong median in [0.70, 1.50]; ratio of medians >= 2"
    )


if __name__ == "__main__":
    main()
