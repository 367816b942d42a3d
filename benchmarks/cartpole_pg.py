"""Policy gradients on CartPole-v1: edurl REINFORCE and A2C, and Stable-Baselines3's A2C, in one run.

    python benchmarks/cartpole_pg.py                 # 5 seeds each (about 5 minutes on 2 CPU cores)
    python benchmarks/cartpole_pg.py --seeds 3 --no-sb3

edurl's REINFORCE (8 episodes per update) and A2C run one seed at a time on Gymnasium and on ``TorchCartPole``,
and then ``--stack`` seeds (8 by default) side by side in one process (``num_seeds``, ``TorchCartPole``, one
thread): a seed's "seconds to solve" is then on the shared clock, and the report adds the whole call's wall time.

"Solved" = the mean return of the last 100 *training* episodes reaches 475 (Gymnasium's reward
threshold). Every run uses one CPU thread. SB3 runs with the rl-baselines3-zoo CartPole-v1 settings for
A2C (8 envs, ent_coef 0, otherwise SB3's defaults: n_steps 5, RMSprop lr 7e-4, gamma 0.99, lambda 1).
SB3 is in the `bench` extra: pip install -e ".[bench]".

The A2C rows compare two configurations, not two implementations of one: edurl's ``A2CConfig`` defaults (8 envs
x 64 steps, Adam lr 2.5e-3, lambda 0.95, advantages standardised per batch) against the zoo's (8 envs x 5 steps,
RMSprop lr 7e-4, lambda 1). Each is its library's recommended setting; a gap between them says which recipe
solves CartPole sooner, not which code is faster at the same arithmetic.
"""

from __future__ import annotations

import argparse

from _args import seed_count  # benchmarks/ is on sys.path when a script runs
from _common import print_table, run_edurl, run_edurl_stacked, run_sb3, warm_up

from edurl.rl import A2CConfig, ReinforceConfig, train_a2c, train_reinforce


def sb3_a2c(seed):
    from stable_baselines3 import A2C
    from stable_baselines3.common.env_util import make_vec_env

    return A2C("MlpPolicy", make_vec_env("CartPole-v1", n_envs=8, seed=seed), ent_coef=0.0, seed=seed, device="cpu")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=seed_count, default=5, help="number of seeds: 0 .. N-1 for each library")
    parser.add_argument("--no-sb3", action="store_true", help="skip Stable-Baselines3")
    parser.add_argument(
        "--single-episode", action="store_true", help="also run classic REINFORCE with one episode per update"
    )
    parser.add_argument("--sb3-max-steps", type=int, default=1_000_000)
    parser.add_argument("--stack", type=int, default=8, help="REINFORCE and A2C seeds in one process (0: skip)")
    args = parser.parse_args()
    warm_up()
    seeds = list(range(args.seeds))
    print("running ...")
    rows = run_edurl(
        "edurl REINFORCE (8 ep/update)", lambda s: ReinforceConfig(seed=s, progress=False), train_reinforce, seeds
    )
    rows += run_edurl(
        "edurl REINFORCE (8 ep/update, TorchCartPole)",
        lambda s: ReinforceConfig(seed=s, env_backend="torch", progress=False),
        train_reinforce,
        seeds,
    )
    if args.stack:
        stacked, total = run_edurl_stacked(
            f"edurl REINFORCE, {args.stack} seeds in one process (TorchCartPole)",
            ReinforceConfig(seed=0, num_seeds=args.stack, env_backend="torch", progress=False),
            train_reinforce,
        )
        rows += stacked
        print(f"  REINFORCE stack: {total / args.stack:.2f} s of wall time per seed", flush=True)
    if args.single_episode:
        rows += run_edurl(
            "edurl REINFORCE (1 ep/update)",
            lambda s: ReinforceConfig(seed=s, episodes_per_update=1, learning_rate=0.002, progress=False),
            train_reinforce,
            seeds,
        )
    for backend, name in (
        ("gymnasium", "edurl A2C + GAE (gymnasium vector)"),
        ("torch", "edurl A2C + GAE (TorchCartPole)"),
    ):
        rows += run_edurl(
            name,
            lambda s, b=backend: A2CConfig(seed=s, env_backend=b, progress=False, total_steps=1_000_000),
            train_a2c,
            seeds,
        )
    if args.stack:
        stacked, total = run_edurl_stacked(
            f"edurl A2C + GAE, {args.stack} seeds in one process (TorchCartPole)",
            A2CConfig(seed=0, num_seeds=args.stack, env_backend="torch", progress=False, total_steps=1_000_000),
            train_a2c,
        )
        rows += stacked
        print(f"  A2C stack: {total / args.stack:.2f} s of wall time per seed", flush=True)
    if not args.no_sb3:
        rows += run_sb3("SB3 A2C (zoo)", sb3_a2c, seeds, args.sb3_max_steps)
    print_table(
        rows,
        "SB3 A2C (zoo)",
        f"CartPole-v1, {len(seeds)} seeds, solved = 100-episode training mean >= 475; "
        "median (min-max) over solved seeds; 1 CPU thread",
    )


if __name__ == "__main__":
    main()
