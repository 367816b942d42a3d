"""Policy gradients on CartPole-v1: edurl REINFORCE and A2C, and Stable-Baselines3's A2C, in one run.

    python benchmarks/cartpole_pg.py                 # 5 seeds each (about 5 minutes on 2 CPU cores)
    python benchmarks/cartpole_pg.py --seeds 3 --no-sb3

"Solved" = the mean return of the last 100 *training* episodes reaches 475 (Gymnasium's reward
threshold). Every run uses one CPU thread. SB3 runs with the rl-baselines3-zoo CartPole-v1 settings for
A2C (8 envs, ent_coef 0, otherwise SB3's defaults: n_steps 5, RMSprop lr 7e-4, gamma 0.99, lambda 1).
SB3 is in the `bench` extra: pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from edurl.rl import A2CConfig, ReinforceConfig, solved_at, train_a2c, train_reinforce


def run_edurl(name, make_config, train, seeds):
    rows = []
    for seed in seeds:
        t0 = time.perf_counter()
        r = train(make_config(seed))
        rows.append({"algo": name, "seed": seed, "solved": r.solved, "episodes": r.solved_episode,
                     "steps": r.solved_step, "seconds": r.solved_time, "run_seconds": time.perf_counter() - t0})
        print(f"  {name:28s} seed {seed}: {'solved' if r.solved else 'NOT solved'} "
              f"episodes={r.solved_episode} steps={r.solved_step} seconds={r.solved_time and round(r.solved_time, 1)}",
              flush=True)
    return rows


def run_sb3_a2c(seeds, max_steps):
    from stable_baselines3 import A2C
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    class SolveTracker(BaseCallback):
        def __init__(self):
            super().__init__()
            self.returns, self.steps, self.times = [], [], []
            self.start = time.perf_counter()

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    self.returns.append(info["episode"]["r"])
                    self.steps.append(self.num_timesteps)
                    self.times.append(time.perf_counter() - self.start)
            return solved_at(self.returns) is None  # stop once solved

    rows = []
    for seed in seeds:
        env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
        model = A2C("MlpPolicy", env, ent_coef=0.0, seed=seed, device="cpu")
        tracker = SolveTracker()
        t0 = time.perf_counter()
        model.learn(max_steps, callback=tracker)
        i = solved_at(tracker.returns)
        row = {"algo": "SB3 A2C (zoo)", "seed": seed, "solved": i is not None, "episodes": None if i is None else i + 1,
               "steps": None if i is None else tracker.steps[i], "seconds": None if i is None else tracker.times[i],
               "run_seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"  {'SB3 A2C (zoo)':28s} seed {seed}: {'solved' if row['solved'] else 'NOT solved'} "
              f"episodes={row['episodes']} steps={row['steps']} seconds={row['seconds'] and round(row['seconds'], 1)}",
              flush=True)
    return rows


def summarise(rows):
    import pandas as pd

    df = pd.DataFrame(rows)
    out = []
    for algo, g in df.groupby("algo", sort=False):
        s = g[g["solved"]]
        def stat(col):
            v = s[col].astype(float)
            return (v.median(), v.min(), v.max()) if len(v) else (np.nan,) * 3
        out.append({"algo": algo, "solve rate": f"{len(s)}/{len(g)}", "episodes": stat("episodes"),
                    "steps": stat("steps"), "seconds": stat("seconds")})
    return out


def fmt(triple, digits=0):
    med, lo, hi = triple
    if np.isnan(med):
        return "-"
    f = f"{{:,.{digits}f}}"
    return f"{f.format(med)} ({f.format(lo)}-{f.format(hi)})"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--no-sb3", action="store_true", help="skip Stable-Baselines3")
    parser.add_argument("--single-episode", action="store_true",
                        help="also run classic REINFORCE with one episode per update")
    parser.add_argument("--sb3-max-steps", type=int, default=1_000_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = list(range(args.seeds))
    rows = []
    print("running ...")
    rows += run_edurl("edurl REINFORCE (8 ep/update)", lambda s: ReinforceConfig(seed=s, progress=False),
                      train_reinforce, seeds)
    if args.single_episode:
        rows += run_edurl("edurl REINFORCE (1 ep/update)",
                          lambda s: ReinforceConfig(seed=s, episodes_per_update=1, lr=0.002, progress=False),
                          train_reinforce, seeds)
    rows += run_edurl("edurl A2C + GAE", lambda s: A2CConfig(seed=s, progress=False, total_steps=1_000_000),
                      train_a2c, seeds)
    if not args.no_sb3:
        rows += run_sb3_a2c(seeds, args.sb3_max_steps)

    table = summarise(rows)
    print(f"\nCartPole-v1, {len(seeds)} seeds, solved = 100-episode training mean >= 475; median (min-max) over "
          "solved seeds; 1 CPU thread")
    print(f"{'algorithm':30s} {'solved':>7s} {'episodes to solve':>22s} {'env steps to solve':>28s} "
          f"{'seconds to solve':>20s}")
    for t in table:
        print(f"{t['algo']:30s} {t['solve rate']:>7s} {fmt(t['episodes']):>22s} {fmt(t['steps']):>28s} "
              f"{fmt(t['seconds'], 1):>20s}")
    by = {t["algo"]: t for t in table}
    if "SB3 A2C (zoo)" in by:
        sb3 = by["SB3 A2C (zoo)"]
        print("\nratios to SB3 A2C (median; < 1 means edurl needs less):")
        for algo in by:
            if algo != "SB3 A2C (zoo)" and not np.isnan(sb3["steps"][0]) and not np.isnan(by[algo]["steps"][0]):
                print(f"  {algo:30s} env steps x{by[algo]['steps'][0] / sb3['steps'][0]:.2f}   "
                      f"seconds x{by[algo]['seconds'][0] / sb3['seconds'][0]:.2f}")


if __name__ == "__main__":
    main()
