"""Shared pieces of the CartPole benchmarks: run edurl and SB3 trainers, time them the same way, print a table."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
import pandas as pd
import torch

from edurl.rl import evaluate_policy, solved_at


def warm_up() -> None:
    """One-time costs (torch's lazy imports on the first optimizer) are paid before any timed run."""
    torch.set_num_threads(1)
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])


def _edurl_row(name, seed, r, run_seconds, greedy_episodes):
    row = {
        "algo": name,
        "seed": seed,
        "solved": r.solved,
        "episodes": r.solved_episode,
        "steps": r.solved_step,
        "seconds": r.solved_time,
        "run_seconds": run_seconds,
    }
    if greedy_episodes and r.solved:
        row["greedy"] = float(evaluate_policy(r.policy, "CartPole-v1", greedy_episodes, torch.device("cpu")).mean())
    _print_row(row)
    return row


def run_edurl(name, make_config, train, seeds, greedy_episodes=0):
    rows = []
    for seed in seeds:
        t0 = time.perf_counter()
        r = train(make_config(seed))
        rows.append(_edurl_row(name, seed, r, time.perf_counter() - t0, greedy_episodes))
    return rows


def run_edurl_stacked(name, config, train, greedy_episodes=0):
    """One call that trains ``config.num_seeds`` seeds side by side; a row per seed (its solve point on the shared
    clock) and the call's total wall seconds."""
    t0 = time.perf_counter()
    results = train(config)
    total = time.perf_counter() - t0
    rows = [_edurl_row(name, config.seed + i, r, total, greedy_episodes) for i, r in enumerate(results)]
    print(f"  {name}: all {len(results)} seeds in {total:.1f} s of wall time", flush=True)
    return rows, total


class SolveLog:
    """The training episodes a peer's run ends, with the env step and clock time of each."""

    def __init__(self):
        self.returns, self.steps, self.times = [], [], []
        self.start = time.perf_counter()

    def record(self, infos, num_timesteps: int) -> bool:
        """Log the episodes that ended in ``infos`` (Gymnasium's ``RecordEpisodeStatistics`` entries); False once
        solved. The solve test reads the last 100 returns, which change only when an episode ends, so it runs only
        then: testing on every step charged SB3 about 1 % (PPO) to 5 % (A2C) of its time for our bookkeeping."""
        ended = False
        for info in infos:
            if "episode" in info:
                self.returns.append(info["episode"]["r"])
                self.steps.append(num_timesteps)
                self.times.append(time.perf_counter() - self.start)
                ended = True
        return not ended or solved_at(self.returns) is None


def run_sb3(name, make_model, seeds, budget, greedy_episodes=0):
    from stable_baselines3.common.callbacks import BaseCallback

    class SolveTracker(BaseCallback, SolveLog):
        def __init__(self):
            BaseCallback.__init__(self)
            SolveLog.__init__(self)

        def _on_step(self) -> bool:
            return self.record(self.locals["infos"], self.num_timesteps)  # stop once solved

    rows = []
    for seed in seeds:
        tracker = SolveTracker()  # the clock starts before the model is built, as edurl's does
        model = make_model(seed)
        t0 = time.perf_counter()
        model.learn(budget, callback=tracker)
        i = solved_at(tracker.returns)
        row = {
            "algo": name,
            "seed": seed,
            "solved": i is not None,
            "episodes": None if i is None else i + 1,
            "steps": None if i is None else tracker.steps[i],
            "seconds": None if i is None else tracker.times[i],
            "run_seconds": time.perf_counter() - t0,
        }
        if greedy_episodes and i is not None:
            row["greedy"] = sb3_greedy(model, greedy_episodes)
        rows.append(row)
        _print_row(row)
    return rows


def sb3_greedy(model, num_episodes: int, seed: int = 10_000) -> float:
    env, returns = gym.make("CartPole-v1"), []
    for k in range(num_episodes):
        obs, _ = env.reset(seed=seed + k)
        total, done = 0.0, False
        while not done:
            action, _ = model.predict(obs, deterministic=True)
            obs, r, term, trunc, _ = env.step(int(action))
            total, done = total + r, term or trunc
        returns.append(total)
    return float(np.mean(returns))


def _print_row(row):
    secs = row["seconds"]
    print(
        f"  {row['algo']:30s} seed {row['seed']}: {'solved' if row['solved'] else 'NOT solved'} "
        f"episodes={row['episodes']} steps={row['steps']} seconds={secs and round(secs, 1)}"
        + (f" greedy={row['greedy']:.1f}" if "greedy" in row else ""),
        flush=True,
    )


def _stat(values):
    v = pd.Series(values, dtype=float).dropna()
    return (v.median(), v.min(), v.max()) if len(v) else (np.nan,) * 3


def _fmt(triple, digits=0):
    med, lo, hi = triple
    if np.isnan(med):
        return "-"
    f = f"{{:,.{digits}f}}"
    return f"{f.format(med)} ({f.format(lo)}-{f.format(hi)})"


def print_table(rows, reference: str, title: str) -> None:
    """Median (min-max) over solved seeds per algorithm, and each algorithm's medians over the reference's."""
    df = pd.DataFrame(rows)
    has_greedy = "greedy" in df.columns
    print(f"\n{title}")
    header = f"{'algorithm':32s} {'solved':>7s} {'env steps to solve':>28s} {'seconds to solve':>20s}"
    print(header + (f" {'greedy return (100 ep)':>24s}" if has_greedy else ""))
    medians, unsolved = {}, {}
    for algo, g in df.groupby("algo", sort=False):
        s = g[g["solved"]]
        steps, secs = _stat(s["steps"]), _stat(s["seconds"])
        medians[algo] = (steps[0], secs[0])
        if len(s) < len(g):
            unsolved[algo] = f"{len(g) - len(s)} of {len(g)}"
        line = f"{algo:32s} {len(s)}/{len(g):<5d} {_fmt(steps):>28s} {_fmt(secs, 1):>20s}"
        if has_greedy:
            line += f" {_fmt(_stat(s['greedy']), 1):>24s}"
        print(line)
    if reference in medians and not np.isnan(medians[reference][0]):
        ref_steps, ref_secs = medians[reference]
        print(f"\nratios of medians to {reference} (< 1: edurl needs less):")
        for algo, (steps, secs) in medians.items():
            if algo != reference and not np.isnan(steps):
                print(f"  {algo:32s} env steps x{steps / ref_steps:.2f}   seconds x{secs / ref_secs:.2f}")
    for algo, count in unsolved.items():
        print(
            f"  caution: {algo} left {count} seeds unsolved within the budget; its medians and ratios are over "
            "the solved seeds alone, so they flatter it"
        )


def per_seed_ratio(total_seconds: float, num_seeds: int, rows, reference: str) -> float:
    """A stacked run's wall seconds per seed over ``reference``'s median seconds to solve (its solved seeds);
    NaN when the reference solved none."""
    ref = _stat([r["seconds"] for r in rows if r["algo"] == reference and r["solved"]])[0]
    return total_seconds / num_seeds / ref if ref > 0 else float("nan")
