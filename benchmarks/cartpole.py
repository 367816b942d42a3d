"""PPO on CartPole-v1: edurl on Gymnasium vector envs, edurl on TorchCartPole, and Stable-Baselines3, in one run.

    python benchmarks/cartpole.py            # 5 seeds each, then 8 seeds in one process; ~9 minutes on 2 CPU cores
    python benchmarks/cartpole.py --seeds 3 --stack 0

All three use the rl-baselines3-zoo CartPole-v1 PPO hyperparameters, which are edurl's PPOConfig
defaults: 8 envs x 32 steps, one minibatch of 256, 20 epochs, gamma 0.98, lambda 0.8, lr 1e-3 and clip
0.2 both decayed linearly, entropy 0. Both libraries get a 200k-step budget (the schedules' horizon).
"Solved" = the mean of the last 100 training-episode returns reaches 475; then the greedy policy plays
100 fresh episodes. Every run uses one CPU thread. SB3 is in the `bench` extra: pip install -e ".[bench]".
One difference remains in the loss: SB3's value loss is ``F.mse_loss`` (no 1/2), edurl's is
``0.5 * mean((V - R)^2)``, so at the same ``vf_coef`` 0.5 SB3's value gradient is twice edurl's; both are
each library's own recipe, and the policy's surrogate is the same.

Last, ``--stack`` seeds (8) train side by side in one process (``PPOConfig(num_seeds=8)``, TorchCartPole), on
1 and then on ``--stack-threads`` torch threads; a seed's "seconds to solve" is then on the shared clock, and the
table adds the whole call's wall time over one seed's: the mean of the median single-seed TorchCartPole run
just before the stacks and, run again, just after them (since 2026-11-29; the machine's speed drifts over a run).
Each stack's line also gives its wall seconds per seed over SB3's median seconds to solve. SB3 ran on one thread,
so the 1-thread stack's ratio is the like-for-like one; the 2-thread stack's uses the second core SB3 did not
(since 2026-12-01; before, only the 2-thread figure was quoted against SB3). Thread counts are those the run
got, after ``$EDURL_MAX_THREADS`` caps the one asked for.
"""

from __future__ import annotations

import argparse

import numpy as np
from _args import seed_count  # benchmarks/ is on sys.path when a script runs
from _common import per_seed_ratio, print_table, run_edurl, run_edurl_stacked, run_sb3, warm_up

from edurl.rl import PPOConfig, train_ppo
from edurl.utils import cpu_threads

BUDGET = 200_000


def sb3_ppo(seed):
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    def linear(start):
        return lambda progress_remaining: progress_remaining * start

    return PPO(
        "MlpPolicy",
        make_vec_env("CartPole-v1", n_envs=8, seed=seed),
        n_steps=32,
        batch_size=256,
        n_epochs=20,
        gamma=0.98,
        gae_lambda=0.8,
        learning_rate=linear(1e-3),
        clip_range=linear(0.2),
        ent_coef=0.0,
        seed=seed,
        device="cpu",
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=seed_count, default=5, help="number of seeds: 0 .. N-1 for each library")
    parser.add_argument("--no-sb3", action="store_true", help="skip Stable-Baselines3")
    parser.add_argument("--stack", type=int, default=8, help="seeds to train in one process (0: skip)")
    parser.add_argument("--stack-threads", type=int, default=2, help="torch threads for the second stacked run")
    args = parser.parse_args()
    warm_up()
    seeds = list(range(args.seeds))
    print("running ...")

    def torch_singles():
        return run_edurl(
            "edurl PPO (TorchCartPole)",
            lambda s: PPOConfig(seed=s, env_backend="torch", total_steps=BUDGET, device="cpu", progress=False),
            train_ppo,
            seeds,
            greedy_episodes=100,
        )

    gym_rows = run_edurl(
        "edurl PPO (gymnasium vector)",
        lambda s: PPOConfig(seed=s, env_backend="gymnasium", total_steps=BUDGET, device="cpu", progress=False),
        train_ppo,
        seeds,
        greedy_episodes=100,
    )
    sb3_rows = [] if args.no_sb3 else run_sb3("SB3 PPO (zoo)", sb3_ppo, seeds, BUDGET, greedy_episodes=100)
    torch_rows = torch_singles()  # right before the stacks, and again right after them (below)
    rows = gym_rows + torch_rows + sb3_rows
    totals = {}
    for threads in sorted({1, cpu_threads(args.stack_threads)}) if args.stack else ():
        # cpu_threads: the count the run gets, after $EDURL_MAX_THREADS caps the one asked for
        name = f"edurl PPO, {args.stack} seeds in 1 process ({threads} thr)"
        config = PPOConfig(
            seed=0,
            num_seeds=args.stack,
            env_backend="torch",
            total_steps=BUDGET,
            device="cpu",
            num_threads=threads,
            progress=False,
        )
        stacked, totals[name] = run_edurl_stacked(name, config, train_ppo, greedy_episodes=100)
        rows += stacked
    after = torch_singles() if totals else []
    print_table(
        rows,
        "SB3 PPO (zoo)",
        f"PPO on CartPole-v1, {len(seeds)} seeds, solved = 100-episode training mean "
        ">= 475; median (min-max) over solved seeds; 1 CPU thread unless marked",
    )
    if not totals:
        return
    # the stacks are compared with the mean of the median single seed before them and after them, so a machine
    # whose speed drifts steadily during the run moves both sides of the ratio alike
    before, later = (np.median([r["run_seconds"] for r in part]) for part in (torch_rows, after))
    single = (before + later) / 2
    steps_repeat = [r["steps"] for r in after] == [r["steps"] for r in torch_rows]
    print(
        f"  median single-seed TorchCartPole run: {before:.1f} s before the stacks, {later:.1f} s after them "
        f"(x{later / before:.2f}; the same solve steps: {steps_repeat}); their mean, {single:.1f} s, is one seed's time"
    )
    for name, total in totals.items():
        ratio = per_seed_ratio(total, args.stack, rows, "SB3 PPO (zoo)")
        print(
            f"  {name}: {total:.1f} s for all of them = x{total / single:.2f} the median single-seed "
            f"TorchCartPole run ({single:.1f} s), {total / args.stack:.1f} s per seed"
            + ("" if np.isnan(ratio) else f" = x{ratio:.3f} SB3's median seconds to solve (SB3 on 1 thread)")
        )


if __name__ == "__main__":
    main()
