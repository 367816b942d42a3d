"""How much room the measured asserts of the notebooks have, over many seeds and other floating-point paths.

    python benchmarks/assert_margins.py              # notebooks 01-05, 10 seeds, 2 variants: ~50 min on 2 cores
    python benchmarks/assert_margins.py --notebooks 02,05 --seeds 3
    python benchmarks/assert_margins.py --variants default,generic,threads=2
    python benchmarks/assert_margins.py --load a.json,b.json    # the table again from saved runs (b's replace a's)
    python benchmarks/assert_margins.py --notebooks 06,07 --variants default   # the LLM chapters: ~10 min a seed
    python benchmarks/_llm_margins.py --out llm.jsonl           # the same LLM runs, one such process per core,
    python benchmarks/assert_margins.py --notebooks 06,07 --load llm.jsonl   # ... then their table

It writes runs/assert_margins.csv (the table) and runs/assert_margins.json (the table and every run, repeats too).

Why: a notebook's RL numbers are one draw. Floating-point sums differ between CPUs and thread counts,
and RL training amplifies the difference, so "seed 0" on a learner's laptop or a GPU is in effect
another seed. An assert is portable only if it holds over the distribution of runs, not on the one
trajectory seen on the machine that wrote it.

How: each experiment repeats a notebook's cells with the notebook's config and library calls. Study
seed k uses trainer seed k and shifts every other seed of the cell (env, sampling, critic fits) by
k * 1,000,000, so k = 0 is the notebook's own run. Experiments that train a torch network also run
under other floating-point paths, one subprocess per variant (see VARIANTS): "generic" makes MKL take
its processor-independent kernels (MKL_CBWR=COMPATIBLE: matrix products blocked and summed in another
order) and torch's own vector kernels run at AVX2 width (ATEN_CPU_CAPABILITY=avx2), the sums of
another CPU; "threads=2" sets ``num_threads=2`` in the trainer configs (with other processes on a
2-core machine, one PPO run then took minutes instead of 10 s). Chapter 1's sampling and the bandit
checks use no matrix products and run in "default" only.

A variant adds a draw only where it changes the outcome. Until 2026-11-29 the second variant was
MKL_ENABLE_INSTRUCTIONS=AVX2 alone, which on the AMD EPYC development machine changed nothing (MKL
already takes its AVX2 kernels there, and torch's own kernels do not read it): each of its runs
repeated the default run to the bit. And the estimates (ESTIMATES: the baseline-variance, GAE and clip
studies) move only in their last digits on another path. So the table counts draws: a run whose
statistics all equal another variant's run of the same experiment and seed (for the estimates: agree
to 0.1 %) is left out (``distinct_runs``), and the script says how many. The JSON keeps every run.

The table gives, per assert, the notebook cell (0-based, markdown cells counted), its statistic's
min / median / max over the runs, how many runs satisfy it, and the margin: the distance from the
worst run to the threshold in standard deviations of the runs (of their logs, for ratios and steps to
solve). A run that never solved counts as failed. Verdict: "ok" when every run holds with a margin
of at least 1 sd, "tight" when every run holds with less (a note says when that is by construction),
"FAILS" otherwise. Where a notebook asserts a median over its k seeds, the statistic is evaluated on
every k-subset of one variant's runs (all C(n, k) of them). Each assert is looked up in its notebook
by its source text: a row says "not in notebook" when the notebook no longer has it. Asserts on
exact values and closed forms are listed as deterministic, without a study.

The experiments of notebooks 06-09 live in ``_llm_margins.py``. Each trains an SFT warm start per
seed and runs GRPO (about 10 minutes a seed on one core), so they run only when asked for.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import _llm_margins  # benchmarks/ is on sys.path when this script runs
import gymnasium as gym
import numpy as np
import pandas as pd
import torch
from _args import seed_count  # benchmarks/ is on sys.path when a script runs
from tqdm.auto import tqdm

from edurl import rl
from edurl.rl.gae_study import gae_bias_variance, sample_trajectory
from edurl.rl.policy_gradient import (
    bandit_exact_gradient,
    bandit_gradient_samples,
    fit_value_baseline,
    gradient_variance,
)
from edurl.rl.ppo import collect_batch, make_env
from edurl.rl.trust_region import clip_vs_no_clip, importance_sampling_study
from edurl.utils import torch_threads

ROOT = Path(__file__).resolve().parents[1]
OFFSET = 1_000_000
"""Study seed k shifts a cell's fixed seeds by k * OFFSET (every cell uses fewer than OFFSET seeds)."""
CPU = torch.device("cpu")
VARIANTS = {  # name: (environment variables of its subprocess, num_threads of the trainers)
    "default": ({}, 1),
    "generic": ({"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}, 1),
    "threads=2": ({}, 2),
}


# ---------------------------------------------------------------- experiments: one function per notebook cell
# Each takes (seed, threads) and returns the measured statistics of one run, by name.


def random_cartpole(seed: int, threads: int) -> dict:
    """Notebook 01, cells 4 and 7: a uniformly random policy on CartPole, with and without a 10-step limit."""
    off = seed * OFFSET
    rng = np.random.default_rng(seed)

    def lengths(env, num_episodes):
        out = []
        for i in range(num_episodes):
            env.reset(seed=off + i)
            length, done = 0, False
            while not done:
                _, _, terminated, truncated, _ = env.step(int(rng.integers(2)))
                length, done = length + 1, terminated or truncated
            out.append((length, terminated, truncated))
        return out

    full = lengths(gym.make("CartPole-v1"), 500)
    short = lengths(gym.make("CartPole-v1", max_episode_steps=10), 200)
    return {
        "random_mean_length": float(np.mean([n for n, _, _ in full])),
        "random_longest": max(n for n, _, _ in full),
        "short_truncated": sum(tr and not te for _, te, tr in short),
    }


def frozenlake_monte_carlo(seed: int, threads: int) -> dict:
    """Notebook 01, cell 27: Monte Carlo play of the greedy and uniform policies against their DP values."""
    mdp = rl.TabularMDP.from_gymnasium(gym.make("FrozenLake-v1"))
    uniform = rl.uniform_policy(mdp)
    V_uniform = rl.solve_policy_values(uniform, mdp, 0.99)
    V_star, greedy, _ = rl.value_iteration(mdp, 0.99)
    env = gym.make("FrozenLake-v1", max_episode_steps=1000)
    out = {}
    for name, policy, V in (("greedy", greedy, V_star), ("uniform", uniform, V_uniform)):
        mc, se = rl.monte_carlo_value(env, policy, 0.99, num_episodes=2000, seed=seed * OFFSET, progress=False)
        out[f"mc_z_{name}"] = abs(mc - V[0].item()) / se
    return out


def _bandit_z(seed: int, num_samples: int, baseline: float) -> float:
    """Largest |estimate - exact| / standard error over the two arms' gradient components."""
    logits = torch.tensor([0.5, -0.5], dtype=torch.float64)
    means, stds = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([1.0, 1.0], dtype=torch.float64)
    exact = bandit_exact_gradient(logits, means)
    s = bandit_gradient_samples(
        logits, means, stds, num_samples, baseline=baseline, generator=torch.Generator().manual_seed(seed)
    )
    se = s.std(0) / len(s) ** 0.5
    return ((s.mean(0) - exact).abs() / se).max().item()


def bandit_reinforce(seed: int, threads: int) -> dict:
    """Notebook 02, cell 3: the score-function estimate from 100,000 samples against the exact gradient."""
    return {"bandit_z": _bandit_z(seed, 100_000, 0.0)}


def bandit_baselines(seed: int, threads: int) -> dict:
    """Notebook 03, cell 3: the same check with 200,000 samples, for baselines 0, 1.27 and 5."""
    return {"bandit_z_baselines": max(_bandit_z(seed, 200_000, b) for b in (0.0, 1.27, 5.0))}


def reinforce_cartpole(seed: int, threads: int) -> dict:
    """Notebooks 02 (cells 8-12) and 03 (cell 10): REINFORCE until solved, then the greedy policy."""
    r = rl.train_reinforce(rl.ReinforceConfig(seed=seed, device="cpu", num_threads=threads, progress=False))
    greedy = rl.evaluate_policy(r.policy, "CartPole-v1", 8, CPU, greedy=True)
    return {
        "reinforce_solved_episode": r.solved_episode if r.solved else math.nan,
        "reinforce_greedy_mean": float(greedy.mean()),
    }


def reinforce_stack(seed: int, threads: int) -> dict:
    """Notebook 02, section 4: eight REINFORCE seeds, 8 * seed ... 8 * seed + 7, side by side in one process on
    TorchCartPole (ReinforceConfig(num_seeds=8, env_backend="torch")); study seed k is the k-th group of eight."""
    results = rl.train_reinforce(
        rl.ReinforceConfig(
            seed=8 * seed, num_seeds=8, env_backend="torch", device="cpu", num_threads=threads, progress=False
        )
    )
    episodes = [r.solved_episode for r in results if r.solved]
    return {
        "reinforce_stack_solved": len(episodes),
        "reinforce_stack_median_solved_episode": float(np.median(episodes)) if episodes else math.nan,
        "reinforce_stack_max_solved_episode": float(max(episodes)) if episodes else math.nan,
    }


def baseline_variance(seed: int, threads: int) -> dict:
    """Notebook 03, cell 5: policy-gradient variance with no, a constant and a learned-value baseline."""
    off = seed * OFFSET
    config = rl.ReinforceConfig(seed=seed, max_episodes=48, device="cpu", num_threads=threads, progress=False)
    policy = rl.train_reinforce(config).policy
    value = fit_value_baseline(policy, "CartPole-v1", num_episodes=128, gamma=0.99, steps=1500, seed=10_000 + off)
    held_out = rl.collect_episodes(
        [gym.make("CartPole-v1") for _ in range(64)], policy.act, CPU, seeds=list(range(20_000 + off, 20_064 + off))
    )
    constant = rl.discounted_returns(held_out.rewards, held_out.dones, 0.99)[held_out.mask].mean().item()
    grads = gradient_variance(
        policy,
        "CartPole-v1",
        {"none": lambda obs, G: 0.0, "constant": lambda obs, G: constant, "learned value": lambda obs, G: value(obs)},
        num_batches=150,
        episodes_per_batch=4,
        seed=50_000 + off,
        progress=False,
    )
    var = {name: g.var(0).sum().item() for name, g in grads.items()}
    cos = torch.nn.functional.cosine_similarity(grads["none"].mean(0), grads["learned value"].mean(0), dim=0)
    return {
        "var_none_over_constant": var["none"] / var["constant"],
        "var_constant_over_value": var["constant"] / var["learned value"],
        "mean_gradient_cosine": cos.item(),
    }


def a2c_stack(seed: int, threads: int) -> dict:
    """Notebook 03, cell 10: eight A2C + GAE seeds, 8 * seed ... 8 * seed + 7, side by side in one process on
    TorchCartPole (A2CConfig(num_seeds=8)), each until solved within the notebook's budget of 1M env steps; study
    seed k is the k-th group of eight."""
    results = rl.train_a2c(
        rl.A2CConfig(
            seed=8 * seed,
            num_seeds=8,
            env_backend="torch",
            device="cpu",
            num_threads=threads,
            total_steps=1_000_000,
            progress=False,
        )
    )
    steps = [r.solved_step for r in results if r.solved]
    return {
        "a2c_solved": len(steps),
        "a2c_median_solved_step": float(np.median(steps)) if steps else math.nan,
        "a2c_max_solved_step": float(max(steps)) if steps else math.nan,
    }


def gae_study(seed: int, threads: int) -> dict:
    """Notebook 04, cell 11: GAE(lambda) bias and variance against Monte Carlo truth, for a rough and a good critic."""
    off = seed * OFFSET
    config = rl.ReinforceConfig(seed=seed, max_episodes=48, device="cpu", num_threads=threads, progress=False)
    policy = rl.train_reinforce(config).policy
    critics = {
        "rough": fit_value_baseline(policy, "CartPole-v1", num_episodes=32, gamma=0.99, steps=300, seed=1_000 + off),
        "good": fit_value_baseline(policy, "CartPole-v1", num_episodes=128, gamma=0.99, steps=1500, seed=2_000 + off),
    }
    episode = sample_trajectory(policy, critics["good"], seed=1 + off)
    picks = torch.linspace(0, len(episode["rewards"]) - 1, 10).long()
    out, best = {}, {}
    for name, critic in critics.items():
        df = gae_bias_variance(
            policy,
            critic,
            episode["states"][picks],
            episode["actions"][picks],
            gamma=0.99,
            num_truth=2048,
            num_samples=256,
            seed=3 + off,
            progress=False,
        )
        # smallest relative increase of the variance from one lambda to the next (>= 0: monotonic)
        out[f"{name}_variance_min_rel_step"] = float((df["variance"].diff() / df["variance"]).min())
        out[f"{name}_bias2_drop"] = float(df["bias2"].iloc[0] - df["bias2"].iloc[-1])
        out[f"{name}_bias2_at_1"] = float(df["bias2"].iloc[-1])
        best[name] = float(df.loc[df["mse"].idxmin(), "lam"])
    out["best_lam_gap"] = best["rough"] - best["good"]
    return out


def ppo_cartpole(seed: int, threads: int) -> dict:
    """Notebook 05, cells 8 and 11: PPO on TorchCartPole until solved, and its diagnostics."""
    r = rl.train_ppo(rl.PPOConfig(seed=seed, env_backend="torch", device="cpu", num_threads=threads, progress=False))
    u = r.updates
    late, ev = u.iloc[len(u) // 2 :], u["explained_variance"]
    return {
        "ppo_solved_step": r.solved_step if r.solved else math.nan,
        "ppo_updates": len(u),
        "kl_k3_min": float(u["approx_kl_k3"].min()),
        "kl_k3_median": float(u["approx_kl_k3"].median()),
        "clip_fraction_median": float(u["clip_fraction"].median()),
        "late_explained_variance": float(late["explained_variance"].median()),
        # other summaries of the critic's progress, to compare with the asserted one
        "early_explained_variance": float(ev.iloc[: max(1, len(u) // 10)].median()),
        "last_quarter_explained_variance": float(ev.iloc[3 * len(u) // 4 :].median()),
        "max_explained_variance": float(ev.max()),
        "entropy_drop": float(u["entropy"].iloc[0] - u["entropy"].iloc[-1]),
    }


def ppo_stack(seed: int, threads: int) -> dict:
    """Notebook 05, section 4's last cell: eight seeds, 8 * seed ... 8 * seed + 7, side by side in one process
    (PPOConfig(num_seeds=8)) with the library's update; study seed k is the k-th group of eight."""
    results = rl.train_ppo(
        rl.PPOConfig(seed=8 * seed, num_seeds=8, env_backend="torch", device="cpu", num_threads=threads, progress=False)
    )
    steps = [r.solved_step for r in results if r.solved]
    return {
        "stack_solved": len(steps),
        "stack_median_solved_step": float(np.median(steps)) if steps else math.nan,
        "stack_max_solved_step": float(max(steps)) if steps else math.nan,
    }


def importance_sampling(seed: int, threads: int) -> dict:
    """Notebook 05, cell 3: importance-sampled estimates of E_pi[x] as pi = N(mu, 1) drifts from q = N(0, 1)."""
    df = importance_sampling_study(seed=seed)
    near = df[df["shift"] <= 1.0]
    return {
        "is_max_bias": float((df["mean_estimate"] - df["shift"]).abs().max()),
        "is_min_std_increase": float(df["batch_std"].diff().min()),
        "is_max_rel_error_near": float(((near["batch_std"] / near["exact_batch_std"]) - 1).abs().max()),
    }


def clip_study(seed: int, threads: int) -> dict:
    """Notebook 05, cell 12: 20 epochs on one batch of a fresh policy, with and without the clip."""
    config = rl.PPOConfig(env_backend="torch", device="cpu")
    with torch_threads(threads):
        torch.manual_seed(seed)
        env, obs, obs_dim, num_actions = make_env(rl.PPOConfig(env_backend="torch", seed=seed), torch.device("cpu"))
        policy, value = rl.CategoricalPolicy(obs_dim, num_actions), rl.ValueNet(obs_dim)
        batch, *_ = collect_batch(env, policy, value, obs, config, torch.device("cpu"))
        df = clip_vs_no_clip(policy, value, batch, config, epochs=20)
    last = df[df["epoch"] == 20].set_index("run")
    return {
        "noclip_over_clip_kl": float(last.loc["no clip", "approx_kl_k3"] / last.loc["clipped", "approx_kl_k3"]),
        "clipped_kl_20": float(last.loc["clipped", "approx_kl_k3"]),
        "noclip_kl_20": float(last.loc["no clip", "approx_kl_k3"]),
    }


EXPERIMENTS = {  # name: (function, whether it trains a torch network and so runs in every variant)
    "random_cartpole": (random_cartpole, False),
    "frozenlake_monte_carlo": (frozenlake_monte_carlo, False),
    "bandit_reinforce": (bandit_reinforce, False),
    "bandit_baselines": (bandit_baselines, False),
    "reinforce_cartpole": (reinforce_cartpole, True),
    "reinforce_stack": (reinforce_stack, True),
    "baseline_variance": (baseline_variance, True),
    "a2c_stack": (a2c_stack, True),
    "gae_study": (gae_study, True),
    "ppo_cartpole": (ppo_cartpole, True),
    "ppo_stack": (ppo_stack, True),
    "importance_sampling": (importance_sampling, False),
    "clip_study": (clip_study, True),
}


# ---------------------------------------------------------------- the asserts, as the notebooks state them


@dataclass
class Check:
    notebook: str
    source: str
    """The assert's text in the notebook, used to find its cell."""
    experiment: str
    statistic: str
    low: float = -math.inf
    """The assert holds when low < value < high (or <= where ``inclusive``)."""
    high: float = math.inf
    inclusive: bool = False
    over_seeds: int = 1
    """1: the notebook asserts on every seed. k > 1: on the median over its k seeds."""
    log: bool = False
    """Measure the margin on a log scale (positive, skewed statistics: ratios, steps to solve)."""
    note: str = ""
    """Why the margin in sd says little here, if it does."""

    def holds(self, x: float) -> bool:
        if math.isnan(x):
            return False
        return (self.low <= x <= self.high) if self.inclusive else (self.low < x < self.high)

    def margin(self, x: float) -> float:
        """Distance to the nearer finite bound (of logs where ``log``); negative when the assert fails."""
        f = np.log if self.log else float
        gaps = [f(x) - f(self.low)] if math.isfinite(self.low) else []
        gaps += [f(self.high) - f(x)] if math.isfinite(self.high) else []
        return min(gaps)

    def threshold(self) -> str:
        lo, hi = ("<=", "<=") if self.inclusive else ("<", "<")
        prefix = f"median of {self.over_seeds}: " if self.over_seeds > 1 else ""
        if math.isinf(self.low):
            return f"{prefix}{hi} {self.high:g}"
        if math.isinf(self.high):
            return f"{prefix}{'>=' if self.inclusive else '>'} {self.low:g}"
        return f"{prefix}{self.low:g} {lo} x {hi} {self.high:g}"


CHECKS = [
    Check("01", "assert 15 < lengths.mean() < 30", "random_cartpole", "random_mean_length", 15, 30),
    Check(
        "01",
        "assert all(terminated and not truncated for _, terminated, truncated in episodes)",
        "random_cartpole",
        "random_longest",
        high=500,
    ),
    Check("01", "assert n_trunc > 100", "random_cartpole", "short_truncated", low=100),
    Check(
        "01",
        "assert abs(mc_greedy - V_star[0].item()) < 4 * se_greedy",
        "frozenlake_monte_carlo",
        "mc_z_greedy",
        high=4,
    ),
    Check(
        "01",
        "assert abs(mc_uniform - V_uniform[0].item()) < 4 * se_uniform",
        "frozenlake_monte_carlo",
        "mc_z_uniform",
        high=4,
    ),
    Check("02", "assert ((estimate - exact).abs() < 4 * se).all()", "bandit_reinforce", "bandit_z", high=4),
    Check(
        "02",
        "assert r.solved and returns.tail(100).mean() >= 475",
        "reinforce_cartpole",
        "reinforce_solved_episode",
        high=3000,
        inclusive=True,
        log=True,
    ),  # solved within max_episodes
    Check(
        "02",
        "assert median_greedy >= 400",
        "reinforce_cartpole",
        "reinforce_greedy_mean",
        low=400,
        inclusive=True,
        over_seeds=3,
    ),
    Check(
        "02",
        "assert sum(r.solved for r in many) >= 6",
        "reinforce_stack",
        "reinforce_stack_solved",
        low=6,
        inclusive=True,
    ),
    Check(
        "02",
        "assert np.median(solved) < 500",
        "reinforce_stack",
        "reinforce_stack_median_solved_episode",
        high=500,
        log=True,
        note="the median of a group of eight",
    ),
    Check("03", "assert ((s.mean(0) - exact).abs() < 4 * se).all()", "bandit_baselines", "bandit_z_baselines", high=4),
    Check(
        "03",
        'assert variance["none"] > variance["constant"] > variance["learned value"]',
        "baseline_variance",
        "var_none_over_constant",
        low=1,
        log=True,
    ),
    Check(
        "03",
        'assert variance["none"] > variance["constant"] > variance["learned value"]',
        "baseline_variance",
        "var_constant_over_value",
        low=1,
        log=True,
    ),
    Check("03", "assert sum(r.solved for r in a2c) >= 7", "a2c_stack", "a2c_solved", low=7, inclusive=True),
    Check(
        "03",
        "assert np.median(solved) < 300_000",
        "a2c_stack",
        "a2c_median_solved_step",
        high=300_000,
        log=True,
        note="the median of a group of eight",
    ),
    # cell 10 prints f"{r.solved_step:,}" for REINFORCE too, which raises unless every run solved
    Check(
        "03", "r.solved_step:,", "reinforce_cartpole", "reinforce_solved_episode", high=3000, inclusive=True, log=True
    ),
    *[
        Check("04", source, "gae_study", f"{critic}_{stat}", low, high, inclusive=inclusive, note=note)
        for critic in ("rough", "good")
        for source, stat, low, high, inclusive, note in (
            ('assert df["variance"].is_monotonic_increasing', "variance_min_rel_step", 0, math.inf, True, ""),
            ('assert df["bias2"].iloc[0] > df["bias2"].iloc[-1]', "bias2_drop", 0, math.inf, False, ""),
            ('assert df["bias2"].iloc[-1] < 1.0', "bias2_at_1", -math.inf, 1.0, False, ""),
        )
    ],
    Check(
        "04",
        'assert best["good critic"] < best["rough critic"]',
        "gae_study",
        "best_lam_gap",
        low=0,
        note="on a grid of lambdas 0.1 apart",
    ),
    Check(
        "05",
        "assert sum(r.solved for r in ppo.values()) >= 2",
        "ppo_cartpole",
        "ppo_solved_step",
        high=200_000,
        inclusive=True,
        log=True,
        note="per seed; the notebook needs 2 of its 3 seeds",
    ),
    Check(
        "05",
        'assert (u["approx_kl_k3"] >= 0).all()',
        "ppo_cartpole",
        "kl_k3_min",
        low=0,
        inclusive=True,
        note="(r - 1) - log r >= 0 for every sample",
    ),
    Check("05", "assert sum(r.solved for r in many) >= 7", "ppo_stack", "stack_solved", low=7, inclusive=True),
    Check(
        "05",
        "assert np.median(solved) < 150_000",
        "ppo_stack",
        "stack_median_solved_step",
        high=150_000,
        log=True,
    ),
    Check("05", 'u["approx_kl_k3"].median() < 0.05', "ppo_cartpole", "kl_k3_median", high=0.05),
    Check("05", 'assert 0 < u["clip_fraction"].median() < 0.3', "ppo_cartpole", "clip_fraction_median", 0, 0.3),
    Check("05", 'assert u["explained_variance"].max() > 0.9', "ppo_cartpole", "max_explained_variance", low=0.9),
    Check("05", 'assert u["entropy"].iloc[-1] < u["entropy"].iloc[0]', "ppo_cartpole", "entropy_drop", low=0),
    Check(
        "05",
        'assert (is_study["mean_estimate"] - is_study["shift"]).abs().max() < 0.1',
        "importance_sampling",
        "is_max_bias",
        high=0.1,
    ),
    Check(
        "05",
        'assert is_study["batch_std"].is_monotonic_increasing',
        "importance_sampling",
        "is_min_std_increase",
        low=0,
        inclusive=True,
    ),
    Check(
        "05",
        'assert ((near["batch_std"] / near["exact_batch_std"]) - 1).abs().max() < 0.1',
        "importance_sampling",
        "is_max_rel_error_near",
        high=0.1,
    ),
    Check(
        "05",
        "assert kl_ratio.median() > 2",
        "clip_study",
        "noclip_over_clip_kl",
        low=2,
        over_seeds=5,
        log=True,
    ),
]

EXPERIMENTS.update(_llm_margins.EXPERIMENTS)
CHECKS += _llm_margins.checks(Check)

DETERMINISTIC = [  # (notebook, assert, why no study is needed)
    (
        "01",
        "assert all(len(rewards) == 10 for rewards, _, truncated in short if truncated)",
        "truncation happens exactly at the time limit",
    ),
    ("01", "assert torch.allclose(G, closed_form, atol=1e-5)", "an identity: holds for any rollout"),
    ("01", "assert torch.allclose(V_uniform, V_exact, atol=1e-8)", "dynamic programming on a known MDP"),
    ("01", "assert (V_star >= V_uniform - 1e-9).all()", "dynamic programming on a known MDP"),
    (
        "01",
        "assert torch.allclose(rl.solve_policy_values(greedy, mdp, gamma), V_star, atol=1e-6)",
        "dynamic programming on a known MDP",
    ),
    ("01", 'assert table["P(reach goal)"].iloc[0] < table["P(reach goal)"].iloc[-1]', "exact solves"),
    ("01", 'assert table["expected steps"].iloc[0] < table["expected steps"].iloc[-1]', "exact solves"),
    ("01", "assert torch.equal(token_returns, torch.ones(num_tokens, 1))", "a closed form"),
    ("02", "assert exact[1] > 0", "an autograd gradient of a closed form"),
    (
        "04",
        "assert torch.equal(advantages, torch.tensor([[12.0, 2.0], [11.0, 1.0], [6.0, 6.0]]))",
        "a hand-computed case",
    ),
    ("05", "assert len(details) >= 6", "counts comments in edurl/rl/ppo.py"),
]
DETERMINISTIC += _llm_margins.DETERMINISTIC


# ---------------------------------------------------------------- running and summarising


def find_cell(notebook: str, source: str) -> int | None:
    """Index of the notebook cell whose source contains ``source``, or None."""
    path = next((ROOT / "notebooks").glob(f"{notebook}_*.ipynb"))
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return next((i for i, c in enumerate(cells) if source in "".join(c["source"])), None)


def run_variant(variant: str, experiments: list[str], seeds: list[int]) -> list[dict]:
    """Every (experiment, seed) of one variant, in this process: one row of measured statistics each."""
    threads = VARIANTS[variant][1]
    jobs = [(name, seed) for name in experiments if variant == "default" or EXPERIMENTS[name][1] for seed in seeds]
    rows = []
    bar = tqdm(jobs, desc=f"runs ({variant})")
    for name, seed in bar:
        bar.set_postfix_str(f"{name} seed {seed}")
        t0 = time.perf_counter()
        stats = EXPERIMENTS[name][0](seed, threads)
        rows.append(
            {
                "experiment": name,
                "variant": variant,
                "seed": seed,
                "seconds": round(time.perf_counter() - t0, 2),
                **stats,
            }
        )
        bar.write(
            f"  {variant:9s} {name:22s} seed {seed:2d} ({rows[-1]['seconds']:6.1f} s): "
            + ", ".join(f"{k}={v:.4g}" for k, v in stats.items())
        )
    return rows


def run_in_subprocess(variant: str, experiments: list[str], seeds: int, out: str) -> list[dict]:
    """Run one variant in a fresh interpreter (MKL reads its instruction set once, when it loads)."""
    env = {k: v for k, v in os.environ.items() if not any(k in e for e, _ in VARIANTS.values())}
    env.update(VARIANTS[variant][0])
    path = f"{out}.{variant.replace('=', '-')}.json"
    subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            "--variants",
            variant,
            "--experiments",
            ",".join(experiments),
            "--seeds",
            str(seeds),
            "--out",
            path,
        ],
        env=env,
        check=True,
    )
    return json.loads(Path(path).read_text(encoding="utf-8"))["runs"]


SAME_DRAW = 1e-3
"""Two runs of an estimate (:data:`ESTIMATES`) whose statistics all agree to this relative tolerance are one draw."""
ESTIMATES = {"baseline_variance", "gae_study", "clip_study"}
"""Experiments whose statistics are estimates from data a seed fixes (a short REINFORCE run, then many sampled
batches), not a long training run: another floating-point path moves them only in their last digits (at most 1.3e-4
relative in the 2026-11-29 study). Every other experiment's runs are one draw only when equal to the bit: a
training run's statistics are few and often discrete (episodes to solve, a greedy return of 500), so two different
trajectories can agree to 0.1 %."""


def distinct_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs without those that repeat another variant's run of the same experiment and seed: every statistic
    (timings aside) equal, or for :data:`ESTIMATES` within :data:`SAME_DRAW` of it.

    A variant adds a draw only where it changes the outcome. One that does not change the arithmetic on this machine
    (MKL_ENABLE_INSTRUCTIONS=AVX2 on an AMD CPU) repeats runs to the bit, and an experiment that estimates a quantity
    from fixed data (the clip and GAE studies) changes only in its last digits when the sums are reordered, where RL
    training amplifies the same change into another run. Counting either twice would double the runs behind an
    assert. The default variant's runs come first and are always kept.
    """
    stats = [c for c in runs.columns if c not in ("experiment", "variant", "seed") and not c.endswith("seconds")]
    records = runs.to_dict("records")

    def close(a, b, tolerance: float) -> bool:
        if pd.isna(a) or pd.isna(b):
            return bool(pd.isna(a) and pd.isna(b))
        return a == b or math.isclose(float(a), float(b), rel_tol=tolerance)

    kept: dict[tuple, list[dict]] = {}
    repeated = np.zeros(len(records), dtype=bool)
    for i in sorted(range(len(records)), key=lambda i: records[i]["variant"] != "default"):  # stable: default first
        run = records[i]
        earlier = kept.setdefault((run["experiment"], run["seed"]), [])
        tolerance = SAME_DRAW if run["experiment"] in ESTIMATES else 0.0
        repeated[i] = any(all(close(run[c], other[c], tolerance) for c in stats) for other in earlier)
        if not repeated[i]:
            earlier.append(run)
    if repeated.any():
        counts = runs[repeated].groupby("variant").size()
        print(
            "runs that repeat another variant's run of the same experiment and seed (every statistic equal, or "
            f"within {SAME_DRAW:g} for estimates), left out of the table: "
            + ", ".join(f"{v}: {n} of {(runs['variant'] == v).sum()}" for v, n in counts.items())
        )
    return runs[~repeated].reset_index(drop=True)


def check_values(check: Check, runs: pd.DataFrame) -> np.ndarray:
    """The asserted statistic of every run, or of every k-subset of a variant's runs for a median over k seeds."""
    runs = runs[runs["experiment"] == check.experiment]
    if check.over_seeds == 1:
        return runs[check.statistic].to_numpy(dtype=float)
    values = []
    for _, group in runs.groupby("variant"):
        x = group[check.statistic].to_numpy(dtype=float)
        values += [float(np.median(x[list(idx)])) for idx in itertools.combinations(range(len(x)), check.over_seeds)]
    return np.asarray(values)


def summarise(runs: pd.DataFrame, notebooks: list[str]) -> pd.DataFrame:
    """One row per assert of the chosen notebooks: its distribution over the runs, and the verdict."""
    rows = []
    for check in CHECKS:
        if check.notebook not in notebooks or check.experiment not in set(runs["experiment"]):
            continue
        x = check_values(check, runs)
        ok = np.array([check.holds(v) for v in x])
        finite = x[~np.isnan(x)]
        worst = min((check.margin(v) for v in finite), default=math.nan)
        scaled = np.log(finite) if check.log else finite
        sd = float(np.std(scaled, ddof=1)) if len(finite) > 1 else math.nan
        margin_sd = worst / sd if sd > 0 else (math.inf if worst > 0 else math.nan)
        verdict = "FAILS" if not ok.all() else ("ok" if margin_sd >= 1 else "tight")
        cell = find_cell(check.notebook, check.source)
        sub = runs[runs["experiment"] == check.experiment]
        rows.append(
            {
                "notebook": check.notebook,
                "cell": "not in notebook" if cell is None else cell,
                "assert": check.source,
                "statistic": check.statistic,
                "threshold": check.threshold(),
                "variants": ",".join(sorted(sub["variant"].unique())),
                "runs": len(x),
                "min": float(np.nanmin(x)) if len(finite) else math.nan,
                "median": float(np.nanmedian(x)) if len(finite) else math.nan,
                "max": float(np.nanmax(x)) if len(finite) else math.nan,
                "holds": f"{ok.sum()}/{len(x)}",
                "margin_sd": margin_sd,
                "verdict": verdict,
                "note": check.note,
            }
        )
    for notebook, source, why in DETERMINISTIC:
        if notebook in notebooks:
            rows.append(
                {
                    "notebook": notebook,
                    "cell": find_cell(notebook, source),
                    "assert": source,
                    "statistic": why,
                    "verdict": "deterministic",
                }
            )
    return pd.DataFrame(rows)


def print_table(table: pd.DataFrame) -> None:
    def num(v):
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"

    print(
        f"\n{'nb':3s} {'cell':>4s} {'statistic':28s} {'threshold':24s} {'variants':19s} {'runs':>5s} "
        f"{'min':>9s} {'median':>9s} {'max':>9s} {'holds':>8s} {'margin':>7s} verdict"
    )
    for r in table.to_dict("records"):
        if r["verdict"] == "deterministic":
            continue
        print(
            f"{r['notebook']:3s} {str(r['cell']):>4s} {r['statistic']:28s} {r['threshold']:24s} {r['variants']:19s} "
            f"{int(r['runs']):>5d} {num(r['min']):>9s} {num(r['median']):>9s} {num(r['max']):>9s} {r['holds']:>8s} "
            f"{num(r['margin_sd']):>7s} {r['verdict']}" + (f" ({r['note']})" if r["note"] else "")
        )
    print(
        "\nmargin: (worst run - threshold) in standard deviations of the runs (of their logs for ratios and "
        "steps to solve);\na run that did not solve (NaN) counts as failed. median of k: over every k-subset of "
        "a variant's runs.\n"
    )
    print("deterministic asserts (no study needed):")
    for r in table[table["verdict"] == "deterministic"].to_dict("records"):
        print(f"  {r['notebook']} cell {r['cell']}: {r['assert']}  ({r['statistic']})")


def _read_runs(path: Path) -> list[dict]:
    """The runs of a JSON written by ``--out``, or of a JSON-lines file written by ``_llm_margins.py``."""
    if path.suffix == ".jsonl":
        return [
            _llm_margins.derived(json.loads(line))
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
    return json.loads(path.read_text(encoding="utf-8"))["runs"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--notebooks", default="01,02,03,04,05", help="comma-separated, e.g. 02,05")
    parser.add_argument("--seeds", type=seed_count, default=10, help="number of study seeds: 0 .. N-1 per variant")
    parser.add_argument("--variants", default="default,generic", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument(
        "--experiments",
        default=None,
        help=f"comma-separated subset of the notebooks' experiments: {', '.join(EXPERIMENTS)}",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="writes OUT.csv (the table) and OUT.json (the table and every "
        "run); default runs/assert_margins, and nothing with --load",
    )
    parser.add_argument(
        "--load",
        default=None,
        help="comma-separated JSONs written by --out: summarise their runs together, run nothing",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one variant, in this process
    args = parser.parse_args()
    notebooks = [n.strip().zfill(2) for n in args.notebooks.split(",")]
    if unknown := sorted(set(notebooks) - {c.notebook for c in CHECKS}):
        parser.error(f"no asserts studied for notebooks {unknown}; choose from {sorted({c.notebook for c in CHECKS})}")
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    if args.experiments and (unknown := sorted(set(args.experiments.split(",")) - set(EXPERIMENTS))):
        parser.error(f"unknown experiments {unknown}; choose from {list(EXPERIMENTS)}")
    if args.load and (missing := [p for p in args.load.split(",") if not Path(p).is_file()]):
        parser.error(f"--load: no such file {missing}; pass JSONs written by --out")
    if args.worker:
        torch.set_num_threads(1)
        print(f"variant {variants[0]}: torch's CPU kernels at {torch.backends.cpu.get_cpu_capability()}")
        runs = run_variant(variants[0], args.experiments.split(","), list(range(args.seeds)))
        Path(args.out).write_text(json.dumps({"runs": runs}, indent=1) + "\n")
        return
    if args.load:
        runs = pd.DataFrame([r for path in args.load.split(",") for r in _read_runs(Path(path))])
        runs = runs.drop_duplicates(["experiment", "variant", "seed"], keep="last")  # a later file replaces runs
    else:
        wanted = list(dict.fromkeys(c.experiment for c in CHECKS if c.notebook in notebooks))
        if args.experiments:
            wanted = [e for e in wanted if e in args.experiments.split(",")]
        args.out = args.out or "runs/assert_margins"
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        runs = pd.DataFrame([r for v in variants for r in run_in_subprocess(v, wanted, args.seeds, args.out)])
        print(f"\nstudy: {len(runs)} runs in {time.perf_counter() - t0:.0f} s")
    table = summarise(distinct_runs(runs), notebooks)  # the JSON keeps every run, repeats too
    if args.out:
        table.to_csv(f"{args.out}.csv", index=False)
        Path(f"{args.out}.json").write_text(
            json.dumps(
                {
                    "table": table.to_dict("records"),
                    "runs": runs.to_dict("records"),
                    "checks": [asdict(c) for c in CHECKS],
                },
                indent=1,
                default=str,
            )
            + "\n"
        )
        print(f"\nwrote {args.out}.csv and {args.out}.json")
    print_table(table)


if __name__ == "__main__":
    main()
