"""Bookkeeping shared by the trainers: the "solved" rule and the table of finished training episodes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

__all__ = ["solved_at", "TrainResult"]


def solved_at(episode_returns, threshold: float = 475.0, window: int = 100) -> int | None:
    """Index (0-based) of the first episode at which the mean of the last ``window`` returns is >= threshold.

    Needs a full window: with fewer than ``window`` episodes nothing counts as solved. Returns None if never.
    CartPole-v1 counts as solved at a 100-episode mean of 475 (its ``reward_threshold`` in Gymnasium).
    """
    x = np.asarray(episode_returns, dtype=float)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}.")
    if len(x) < window:
        return None
    csum = np.concatenate([[0.0], np.cumsum(x)])
    means = (csum[window:] - csum[:-window]) / window  # means[i] covers episodes i .. i+window-1
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

    @classmethod
    def from_episodes(cls, rows: list[dict], config, policy, value) -> "TrainResult":
        df = pd.DataFrame(rows, columns=["episode", "step", "episode_return", "episode_length", "time/total"])
        i = solved_at(df["episode_return"], config.solve_threshold, config.solve_window)
        if i is None:
            return cls(df, None, None, None, policy, value, config)
        row = df.iloc[i]
        return cls(df, i + 1, int(row["step"]), float(row["time/total"]), policy, value, config)

    @property
    def solved(self) -> bool:
        return self.solved_episode is not None
