"""Can the course's reward model learn the simulated people's preferences? Chapter 8's first question, measured.

    python benchmarks/reward_model_learnability.py                    # seeds 0-2, the three settings below
    python benchmarks/reward_model_learnability.py --seeds 0 --epochs 20 --settings "1-digit gold"

For each setting and seed: sample pairs from the cached SFT policy (`preference_data`), label them with the
setting's rater, fit a Bradley-Terry reward model on the SFT weights (`train_reward_model`), and print its
held-out expected pair accuracy beside the exact ceiling (`ceiling`); Chapter 8's target is >= 0.9 x ceiling.

Settings:

* `2-digit gold`: the gold rater on Chapter 6's 2-digit addition, whose replies are bare ``\\boxed{N}``: of the
  gold score only its closeness part, ``-0.3 log(1 + |error|)``, differs between two replies;
* `1-digit gold`: the same on 1-digit addition (its own SFT warm start, trained once and cached);
* `2-digit length-biased`: the rater that also likes longer replies (`length_bonus` per character), whose
  preferences are partly visible in the reply itself;
* `styled gold (Chapter 8)`: the gold rater on Chapter 8's warm start (``rlhf_sft_config``), whose replies also
  differ in manner (an opening, fillers), the part of the gold score a reward model can see;
* `control`: synthetic replies that differ only in length (`length_pairs`), labelled by a
  length-liking rater, on the same SFT weights: a preference the reward model can read off the reply. If the
  control fails too, the pipeline has a bug; if only the others fail, the task's preference is what is hard.

`chance / ceiling` is where a reward model that learned nothing lands (expected accuracy 0.5).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import pandas as pd
from _args import seed_list  # benchmarks/ is on sys.path when a script runs

from edurl.llm.preference import (
    RewardModelConfig,
    length_preference_data,
    preference_data,
    rlhf_sft_config,
    train_reward_model,
)
from edurl.llm.sft import SFTConfig

SETTINGS = {
    "2-digit gold": RewardModelConfig(),
    "1-digit gold": RewardModelConfig(sft=SFTConfig(num_digits=1)),
    "2-digit length-biased": RewardModelConfig(length_bonus=0.5),
    "styled gold (Chapter 8)": RewardModelConfig(sft=rlhf_sft_config()),
    "control": RewardModelConfig(length_bonus=0.5),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=seed_list, default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--epochs", type=int, default=5, help="passes over the training pairs")
    parser.add_argument("--train-problems", type=int, default=1024, help="training problems (about one pair each)")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names from SETTINGS")
    args = parser.parse_args()
    chosen = [name.strip() for name in args.settings.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    rows = []
    for name in chosen:
        base = SETTINGS[name]
        for seed in args.seeds:
            config = replace(
                base,
                seed=seed,
                epochs=args.epochs,
                num_train_problems=args.train_problems,
                num_test_problems=256,
                learning_rate=args.learning_rate,
                eval_every=10_000,  # evaluate at the start and the end only
                progress=False,
            )
            t0 = time.perf_counter()
            pairs = length_preference_data if name.startswith("control") else preference_data
            result = train_reward_model(config, pairs(config))
            end = result.final
            rows.append(
                {
                    "setting": name,
                    "seed": seed,
                    "pairs": len(result.train_pairs),
                    "steps": end["step"],
                    "train loss": end["train/loss"],
                    "held-out acc": end["test/expected_accuracy"],
                    "ceiling": end["test/ceiling"],
                    "acc / ceiling": end["test/expected_accuracy"] / end["test/ceiling"],
                    "chance / ceiling": 0.5 / end["test/ceiling"],
                    "seconds": time.perf_counter() - t0,
                }
            )
            print(f"{name}, seed {seed}: {rows[-1]['acc / ceiling']:.3f} of the ceiling", flush=True)
    table = pd.DataFrame(rows)
    print(table.to_string(index=False, float_format="%.3f"))
    print("\nmedian (min-max) of acc / ceiling over seeds:")
    for name, frame in table.groupby("setting", sort=False):
        r = frame["acc / ceiling"]
        print(f"  {name:24s} {r.median():.3f} ({r.min():.3f}-{r.max():.3f})")


if __name__ == "__main__":
    main()
