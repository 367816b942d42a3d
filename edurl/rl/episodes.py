"""What the classic-RL trainers share: their common config fields, the "solved" rule, and the table of
finished training episodes that every trainer returns."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from edurl._checks import check_count, check_fields

__all__ = ["TrainerConfig", "solved_at", "TrainResult", "EpisodeLog"]


@dataclass
class TrainerConfig:
    """Fields every trainer of Chapters 2–5 has; each algorithm's config adds its own below these."""

    env_id: str = "CartPole-v1"
    """Gymnasium id of an env with a discrete action space and vector observations."""
    seed: int = 0
    """Seeds torch, numpy and the environments."""
    solve_threshold: float = 475.0
    """Solved when the mean return of the last ``solve_window`` training episodes reaches this."""
    solve_window: int = 100
    """Number of training episodes in the solve criterion's moving mean."""
    stop_when_solved: bool = True
    """End training at the solve point (benchmarks and notebooks), or keep going to the budget."""
    device: str | None = None
    """"cpu", "cuda", ...; None picks with edurl.device()."""
    num_threads: int | None = 1
    """CPU threads for torch during training (1: fastest for these small nets, and repeatable across machines)."""
    log_dir: str | None = None
    """If set, write metrics.jsonl there (overwriting a previous run)."""
    progress: bool = True
    """Show a progress bar (``edurl.utils.progress``: about 100 redraws at most, so notebooks stay responsive)."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            positive_int=("solve_window", "num_threads"),
            nonneg_int=("seed",),
            finite=("solve_threshold",),
            optional=("num_threads",),
        )


def solved_at(episode_returns, threshold: float = 475.0, window: int = 100) -> int | None:
    """Index (0-based) of the first episode at which the mean of the last ``window`` returns is >= threshold.

    Needs a full window: with fewer than ``window`` episodes nothing counts as solved. Returns None if never.
    CartPole-v1 counts as solved at a 100-episode mean of 475 (its ``reward_threshold`` in Gymnasium).
    """
    x = np.asarray(episode_returns, dtype=float)
    check_count(window, "window", "episodes")
    if len(x) < window:
        return None
    finite = np.isfinite(x)
    csum = np.concatenate([[0.0], np.cumsum(np.where(finite, x, 0.0))])
    means = (csum[window:] - csum[:-window]) / window  # means[i] covers episodes i .. i+window-1
    odd = np.concatenate([[0], np.cumsum(~finite)])
    for i in np.nonzero(odd[window:] - odd[:-window])[0]:  # a NaN or inf in a running sum would reach every
        means[i] = x[i : i + window].mean()  # later window, so those windows alone are summed directly
    hits = np.nonzero(means >= threshold)[0]
    return int(hits[0] + window - 1) if len(hits) else None


@dataclass
class TrainResult:
    """What a trainer returns: every finished training episode, the solve point, and the trained networks."""

    episodes: pd.DataFrame
    """One row per training episode: episode, step (env steps so far), episode_return, episode_length, time/total."""
    solved_episode: int | None
    """Number of training episodes when the solve criterion was first met (None if never)."""
    solved_step: int | None
    """Env steps at that point."""
    solved_time: float | None
    """Wall seconds at that point."""
    policy: torch.nn.Module
    value: torch.nn.Module | None
    config: object
    updates: pd.DataFrame | None = None
    """One row of optimisation diagnostics per update, for trainers that keep them (PPO)."""

    @classmethod
    def from_episodes(cls, rows: list[dict], config, policy, value) -> TrainResult:
        df = pd.DataFrame(rows, columns=["episode", "step", "episode_return", "episode_length", "time/total"])
        i = solved_at(df["episode_return"], config.solve_threshold, config.solve_window)
        if i is None:
            return cls(df, None, None, None, policy, value, config)
        row = df.iloc[i]
        return cls(df, i + 1, int(row["step"]), float(row["time/total"]), policy, value, config)

    @property
    def solved(self) -> bool:
        return self.solved_episode is not None


class EpisodeLog:
    """Finished training episodes as they come in, with the wall clock started at creation."""

    def __init__(self, config: TrainerConfig):
        self.config, self.rows, self.start = config, [], time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def add(self, returns, lengths, step: int) -> None:
        """Record episodes that finished by env step ``step``."""
        now = self.elapsed()
        for ret, length in zip(returns, lengths):
            self.rows.append(
                {
                    "episode": len(self.rows),
                    "step": step,
                    "episode_return": float(ret),
                    "episode_length": int(length),
                    "time/total": now,
                }
            )

    def __len__(self) -> int:
        return len(self.rows)

    def recent_mean(self) -> float:
        recent = [r["episode_return"] for r in self.rows[-self.config.solve_window :]]
        return float(np.mean(recent)) if recent else float("nan")

    def should_stop(self) -> bool:
        return (
            self.config.stop_when_solved
            and solved_at(
                [r["episode_return"] for r in self.rows], self.config.solve_threshold, self.config.solve_window
            )
            is not None
        )

    def result(self, policy, value) -> TrainResult:
        return TrainResult.from_episodes(self.rows, self.config, policy, value)
