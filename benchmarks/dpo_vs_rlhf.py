"""DPO against reward model + RL on Chapter 8's setting, at matched training time: which reaches the higher gold score?

    python benchmarks/dpo_vs_rlhf.py                  # seeds 0-2: about 8 minutes a seed on one core
    python benchmarks/dpo_vs_rlhf.py --seeds 0 --threads 2

Per seed, notebook 08's setting (``_llm_margins.RLHFSetting``: the styled warm start, 1024 pairs labelled by the gold
rater, 256 held-out pairs): a reward model (5 epochs) and 80 GRPO steps against it with beta = 0.2; DPO as in the
notebook (beta 0.1, lr 1e-4, 3 epochs); and DPO again with as many epochs as fit in the seconds that the reward model
and RL took together in this run (``time/train`` of the reward model plus RL's ``time/total``; evaluations excluded).
Every policy is judged by its mean gold score on 128 held-out problems x 4 replies, the scale of the notebook's
table. Prints one row per seed and method, then medians with min-max over seeds.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time

import pandas as pd
import torch
from _args import seed_list  # benchmarks/ is on sys.path when a script runs
from _llm_margins import RLHFSetting  # benchmarks/ is on sys.path when this script runs

from edurl.llm.preference import train_reward_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=seed_list, default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the study of notebook 08 used 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for seed in args.seeds:
        t0 = time.perf_counter()
        setting = RLHFSetting.make(seed, args.threads)
        rm = train_reward_model(setting.rm_config, setting.data)
        rl = setting.grpo(rm.model, setting.data.rater, 0.2, tempfile.mkdtemp(prefix="edurl-dpo-vs-rlhf-"))
        rlhf_seconds = rm.final["time/train"] + float(rl.metrics["time/total"].iloc[-1])
        dpo = setting.dpo()
        epochs = max(3, math.ceil(3 * rlhf_seconds / dpo.final["time/train"]))
        matched = setting.dpo(epochs=epochs, eval_every=10**6)
        ratio = lambda h: h["test/expected_accuracy"] / h["test/ceiling"]  # noqa: E731
        for method, seconds, policy, acc in (
            ("SFT warm start", 0.0, setting.policy, math.nan),
            ("reward model + RL", rlhf_seconds, rl.trainer.model, ratio(rm.final)),
            ("DPO, 3 epochs", dpo.final["time/train"], dpo.policy, ratio(dpo.final)),
            (f"DPO, matched time ({epochs} epochs)", matched.final["time/train"], matched.policy, ratio(matched.final)),
        ):
            rows.append(
                {
                    "seed": seed,
                    "method": method.split(" (")[0],
                    "epochs": epochs if method.startswith("DPO, matched") else None,
                    "train s": seconds,
                    "pair acc / ceiling": acc,
                    "held-out gold": setting.gold_of(policy),
                }
            )
            print(rows[-1], flush=True)
        print(f"seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    table = pd.DataFrame(rows)
    print(table.to_string(index=False, float_format="%.3f"))
    print("\nmedian (min-max) over seeds:")
    for method, frame in table.groupby("method", sort=False):
        g, s = frame["held-out gold"], frame["train s"]
        print(f"  {method:26s} gold {g.median():+.2f} ({g.min():+.2f} to {g.max():+.2f})   train {s.median():.0f} s")


if __name__ == "__main__":
    main()
