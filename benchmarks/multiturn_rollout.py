"""How much Chapter 9's prefix cache saves in a multi-turn rollout: ``do_group_rollouts`` with and without it.

Without the cache, every turn sends the whole conversation to the sampler, which runs all of it through the model
again. With ``prefix_cache=True`` each episode keeps its keys and values between turns, and a turn runs only the
tokens added since the last one (the end of the model's reply and the environment's answer;
``edurl.llm.sampling.PrefixCache``). Both arms play the same groups from the same warm start with the same seeds,
alternating, so a slow moment of the machine hits both.

    python benchmarks/multiturn_rollout.py                      # guess_number, seed 2's warm start, 8 x 8 episodes
    python benchmarks/multiturn_rollout.py --game calculator --reps 5

Prints each arm's median seconds per rollout and prompt tokens run per rollout, their ratios, and the share of
episodes whose every action came out the same in both arms (the cache changes rounding only, so a draw differs
only when two tokens' probabilities straddle the random number to within rounding).
"""

from __future__ import annotations

import argparse
import statistics
import time

import pandas as pd
import torch
from multiturn_games import RECIPES  # benchmarks/ is on sys.path when this script runs

from edurl.llm import ChatMLRenderer, SamplingClient, SamplingParams
from edurl.llm.envs import do_group_rollouts
from edurl.llm.multiturn import GameSFTConfig, MultiTurnConfig, game_builders, load_or_train_game_sft


class CountingSampler(SamplingClient):
    """Counts the prompt tokens the model runs: all of each prompt, less what a prefix cache supplied."""

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self.prompt_tokens = 0

    def sample_batch(self, prompts, num_samples=1, sampling_params=None, prefix_cache=None, cache_keys=None):
        saved = prefix_cache.saved_tokens if prefix_cache is not None else 0
        out = super().sample_batch(prompts, num_samples, sampling_params, prefix_cache, cache_keys)
        if prefix_cache is not None:
            saved = prefix_cache.saved_tokens - saved
        self.prompt_tokens += sum(len(p) for p in prompts) - saved
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--game", choices=sorted(RECIPES), default="guess_number")
    ap.add_argument("--seed", type=int, default=2, help="the warm start's seed (trained and cached if missing)")
    ap.add_argument("--reps", type=int, default=4, help="rollouts per arm")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    torch.set_num_threads(args.threads)
    sft = GameSFTConfig(game=args.game, seed=args.seed, num_threads=args.threads, **RECIPES[args.game]["sft"])
    model, tok, _, _ = load_or_train_game_sft(sft)
    env_kwargs = MultiTurnConfig(
        sft=sft, seed=args.seed, **RECIPES[args.game]["rl"]
    ).env_kwargs()  # the RL recipe's rewards
    renderer = ChatMLRenderer(tok)
    seconds = {False: [], True: []}
    tokens = {False: [], True: []}
    actions = {False: [], True: []}
    for rep in range(args.reps):
        for cached in (False, True):
            builders = game_builders(
                args.game, renderer, args.groups, 1000 + rep, "train", args.group_size, **env_kwargs
            )
            sampler = CountingSampler(model, tok)
            params = SamplingParams(max_tokens=24, temperature=1.0, seed=rep)
            t0 = time.perf_counter()
            groups = do_group_rollouts(builders, sampler, params, prefix_cache=cached)
            seconds[cached].append(time.perf_counter() - t0)
            tokens[cached].append(sampler.prompt_tokens)
            actions[cached] += [[x.ac.tokens for x in t.transitions] for g in groups for t in g.trajectories]
    same = sum(a == b for a, b in zip(actions[False], actions[True], strict=True))
    rows = [
        {
            "arm": "whole conversation each turn" if not cached else "prefix cache",
            "median s / rollout": statistics.median(seconds[cached]),
            "min-max s": f"{min(seconds[cached]):.2f}-{max(seconds[cached]):.2f}",
            "prompt tokens run / rollout": statistics.median(tokens[cached]),
        }
        for cached in (False, True)
    ]
    print(
        f"\n{args.game}, seed {args.seed}'s warm start, {args.groups} x {args.group_size} episodes per rollout, "
        f"T = 1, {args.reps} rollouts per arm, {args.threads} threads\n"
    )
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:,.3f}"))
    print(
        f"\nprefix cache / whole: {rows[1]['median s / rollout'] / rows[0]['median s / rollout']:.2f}x the seconds, "
        f"{rows[1]['prompt tokens run / rollout'] / rows[0]['prompt tokens run / rollout']:.2f}x the prompt tokens; "
        f"episodes with the same actions in both arms: {same} of {len(actions[False])}"
    )


if __name__ == "__main__":
    main()
