"""Figures the chapters share: learning curves over seeds, value grids for tabular MDPs, and a datum's mask.

``align_curves`` does the arithmetic (rolling mean, common x grid) and is tested on hand-computed
values; the ``plot_*`` functions only draw what it returns.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from edurl._checks import check_count, check_tensor, is_whole
from edurl.utils import warn_at_caller

__all__ = [
    "GRPO_PANELS",
    "align_curves",
    "plot_datum_layout",
    "plot_grpo_metrics",
    "plot_learning_curves",
    "plot_value_grid",
    "rolling_mean",
]


def rolling_mean(values, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` values; the first ``window - 1`` use what exists so far.

    rolling_mean([1, 2, 3, 4], 2) = [1, 1.5, 2.5, 3.5]. The "100-episode mean return" of Chapter 2 is
    rolling_mean(returns, 100)[-1].

    A NaN or inf reaches only the windows that hold it (a diverged step leaves the rest of a curve as it was).
    """
    check_count(window, "window", "values")
    x = np.asarray(values, dtype=float)
    if x.ndim != 1:
        raise ValueError(f"values must be 1-D, got shape {x.shape}.")
    if len(x) == 0:
        return x.copy()
    idx = np.arange(1, len(x) + 1)
    count = np.minimum(idx, window)
    if np.isfinite(x).all() and np.abs(x).max() < 1e12:
        csum = np.concatenate([[0.0], np.cumsum(x)])  # one pass; exact enough while no value dwarfs the others
        return (csum[idx] - csum[idx - count]) / count
    # each window summed on its own: a running sum carries a NaN or inf into every later window, and a value
    # of 1e16 swallows the small ones after it
    w = min(int(window), len(x))
    padded = np.concatenate([np.zeros(w - 1), x])
    return np.lib.stride_tricks.sliding_window_view(padded, w).sum(axis=1) / count


def align_curves(
    curves: Sequence[pd.DataFrame], x: str, y: str, *, window: int = 1, num_points: int = 200
) -> tuple[np.ndarray, np.ndarray]:
    """Smooth each seed's curve with ``rolling_mean`` and interpolate all of them onto one x grid.

    Seeds log at different x (episodes end at different steps; wall times differ), so their curves
    are resampled by linear interpolation onto ``num_points`` evenly spaced x values. The grid spans
    only the x range every seed covers: no curve is extrapolated past its own data.

    Returns ``grid`` (num_points,) and ``Y`` (num_seeds, num_points).
    """
    if isinstance(curves, pd.DataFrame):  # one seed's curve (iterating a DataFrame gives its column names)
        curves = [curves]
    check_count(num_points, "num_points", "points")
    if len(curves) == 0:
        raise ValueError("no curves to align: pass one DataFrame per seed.")
    series, ends = [], []
    for i, df in enumerate(curves):
        if not isinstance(df, pd.DataFrame):
            raise TypeError(
                f"curve {i} is a {type(df).__name__}; pass one DataFrame per seed (a list of them, or one DataFrame)."
            )
        for col in (x, y):
            if col not in df.columns:
                raise KeyError(f"curve {i} has no column {col!r}; its columns are {list(df.columns)}.")
        d = df[[x, y]].dropna().sort_values(x)  # rows that did not log y (sparse logs) are skipped
        if len(d) == 0:
            raise ValueError(f"curve {i} has no rows with both {x!r} and {y!r}.")
        series.append((d[x].to_numpy(float), rolling_mean(d[y].to_numpy(float), window)))
        ends.append(float(df[x].max()))  # where the curve's own x runs to, with or without a y there
    lo = max(s[0][0] for s in series)
    hi = min(s[0][-1] for s in series)
    short = min(range(len(series)), key=lambda i: series[i][0][-1])
    first, last_y, last_x = series[short][0][0], series[short][0][-1], ends[short]
    if len(series) > 1 and last_x - last_y > 0.1 * (last_x - first):
        warn_at_caller(
            f"curve {short}'s {y!r} has no value after {x} {last_y:g} (NaN there: not logged, or the run diverged), "
            f"though its {x!r} runs to {last_x:g}; the curves are averaged only where all have values, so the grid "
            f"stops at {last_y:g} for every curve. Plot that curve on its own to see it."
        )
    if lo > hi:
        raise ValueError(f"the curves share no common {x!r} range; they cannot be averaged point by point.")
    grid = np.linspace(lo, hi, num_points) if hi > lo else np.array([lo])
    Y = np.stack([np.interp(grid, xs, ys) for xs, ys in series])
    return grid, Y


def plot_learning_curves(
    runs: Mapping[str, Sequence[pd.DataFrame]] | Sequence[pd.DataFrame],
    *,
    x: str = "step",
    y: str = "episode_return",
    window: int = 100,
    band: str = "minmax",
    ax: plt.Axes | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    title: str | None = None,
) -> plt.Axes:
    """Draw the seed-mean of each run's smoothed curve, with a band across seeds.

    ``runs`` maps a label to one DataFrame per seed (a plain list is one unlabelled run). ``x`` is a
    column such as ``"step"`` (env steps) or ``"time/total"`` (wall seconds). ``band`` is
    ``"minmax"`` (the range over seeds), ``"std"`` (mean ± one standard deviation) or ``"none"``.
    """
    if band not in ("minmax", "std", "none"):
        raise ValueError(f"band must be 'minmax', 'std' or 'none', got {band!r}.")
    if not isinstance(runs, Mapping):
        runs = {None: runs}
    ax = ax if ax is not None else plt.subplots(figsize=(7, 4))[1]
    for label, curves in runs.items():
        grid, Y = align_curves(curves, x, y, window=window)
        mean = Y.mean(0)
        n = Y.shape[0]
        (line,) = ax.plot(
            grid,
            mean,
            label=f"{label} ({n} seed{'s' if n > 1 else ''})" if label is not None else None,  # 0 and "" too
            marker="o" if len(grid) == 1 else None,  # one point: a line without a marker does not show it
        )
        if band != "none" and n > 1:
            lo, hi = (Y.min(0), Y.max(0)) if band == "minmax" else (mean - Y.std(0), mean + Y.std(0))
            ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    default_x = {"step": "env steps", "time/total": "wall time (s)"}.get(x, x)
    ax.set_xlabel(xlabel or default_x)
    ax.set_ylabel(ylabel or (f"{y} (rolling mean of {window})" if window > 1 else y))
    if title:
        ax.set_title(title)
    if any(label is not None for label in runs):
        ax.legend()
    ax.grid(alpha=0.3)
    return ax


_ARROWS = {"left": (-1, 0), "down": (0, 1), "right": (1, 0), "up": (0, -1)}


def plot_value_grid(
    V: torch.Tensor, mdp, *, policy: torch.Tensor | None = None, ax: plt.Axes | None = None, title: str | None = None
) -> plt.Axes:
    """Heatmap of V over a grid world's map, with its letters and, optionally, greedy-policy arrows.

    ``mdp`` is a :class:`edurl.rl.TabularMDP` built from a grid env (it carries ``grid`` and
    ``action_names``). ``policy`` is (S, A); the arrow shows its most likely action in each
    non-terminal state.
    """
    from edurl.rl.tabular import _check_values

    if mdp.grid is None:
        raise ValueError("this MDP has no grid map; plot_value_grid draws grid worlds such as FrozenLake.")
    _check_values(V, mdp)  # a NumPy V, or one of another length, failed inside the drawing
    if policy is not None:  # probabilities, or any (S, A) scores: the arrow shows the argmax
        check_tensor(policy, "policy", ndim=(2,))
        if tuple(policy.shape) != (mdp.num_states, mdp.num_actions):
            raise ValueError(
                f"policy must have shape (S, A) = {(mdp.num_states, mdp.num_actions)}, one row of action "
                f"probabilities per state, got {tuple(policy.shape)}."
            )
    rows, cols = mdp.grid.shape
    values = V.detach().cpu().float().numpy().reshape(rows, cols)  # NumPy has no bfloat16
    ax = ax if ax is not None else plt.subplots(figsize=(4.5, 4.5))[1]
    im = ax.imshow(values, cmap="viridis")
    plt.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="V(s)")
    terminal = mdp.terminal.cpu().numpy().reshape(rows, cols)
    best = policy.argmax(-1).cpu().numpy().reshape(rows, cols) if policy is not None else None
    mid = (values.max() + values.min()) / 2
    for r in range(rows):
        for c in range(cols):
            color = "black" if values[r, c] > mid else "white"
            ax.text(c - 0.38, r - 0.28, mdp.grid[r, c], color=color, fontsize=10, fontweight="bold")
            ax.text(c, r + 0.4, f"{values[r, c]:.2f}", color=color, fontsize=8, ha="center")
            if best is not None and not terminal[r, c] and mdp.action_names:
                dx, dy = _ARROWS[mdp.action_names[best[r, c]]]
                ax.arrow(c - 0.15 * dx, r - 0.05 - 0.15 * dy, 0.18 * dx, 0.18 * dy, head_width=0.12, color=color)
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title)
    return ax


#: the panels of :func:`plot_grpo_metrics`: (metric, title)
GRPO_PANELS = (
    ("env/all/correct", "train correct (sampled, T=1)"),
    ("test/pass_at_1", "held-out pass@1 (greedy)"),
    ("env/all/format", "format"),
    ("optim/entropy", "entropy (nats / token)"),
    ("env/all/by_group/frac_mixed", "frac_mixed (groups with signal)"),
    ("optim/kl_sample_train_v2", "kl_sample_train_v2"),
)


def plot_grpo_metrics(runs, panels=GRPO_PANELS, smooth: int = 10):
    """Learning curves of one or more GRPO (or continued-SFT) runs, Chapter 7: ``runs`` is a metrics DataFrame or ``{label: DataFrame}``.

    Per-step training metrics are drawn as a rolling mean over ``smooth`` steps; evaluations as points.
    """
    if isinstance(runs, pd.DataFrame):
        runs = {"": runs}
    if not isinstance(runs, Mapping) or not all(isinstance(m, pd.DataFrame) for m in runs.values()):
        raise TypeError(
            "plot_grpo_metrics takes one run's metrics DataFrame (load_metrics(log_dir)) or {label: DataFrame}, got "
            f"{type(runs).__name__}; for several runs pass e.g. {{'seed 0': m0, 'seed 1': m1}}."
        )
    check_count(smooth, "smooth", "steps")  # the rolling mean's window; 1 draws the raw values
    if not runs:
        raise ValueError("plot_grpo_metrics got no runs; pass load_metrics(log_dir), or {label: DataFrame}.")
    for label, m in runs.items():
        if "step" not in m.columns:
            raise ValueError(
                f"run {label!r} has no 'step' column (its columns: {list(m.columns)[:8]}); plot_grpo_metrics takes "
                "the DataFrame of load_metrics(log_dir), one row per logged step."
            )
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols, 3.1 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        for label, m in runs.items():
            if key not in m:
                continue
            data = m[["step", key]].dropna()
            if key.startswith("test/"):
                ax.plot(data["step"], data[key], marker="o", label=label or None)
            else:  # a run of one step is one point, which a line without a marker does not show
                ax.plot(data["step"], data[key].rolling(smooth, min_periods=1).mean(), label=label or None,
                        marker="o" if len(data) == 1 else None)  # fmt: skip
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if not any(key in m for key, _ in panels for m in runs.values()):
        warn_at_caller(
            f"none of the runs logged any of the metrics plotted ({', '.join(key for key, _ in panels)}), so every "
            "panel is empty; pass panels=[(column, title), ...] with columns the runs have."
        )
    if len(runs) > 1:
        axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def datum_rows(tokens: Sequence[str], mask: Sequence[float], width: int = 64) -> list[list[tuple[str, float]]]:
    """Lay a datum's target tokens out as lines of text for :func:`plot_datum_layout`: ``(token, mask)`` pairs,
    a new line after each newline token or every ``width`` tokens."""
    if len(tokens) != len(mask):
        raise ValueError(f"{len(tokens)} tokens but {len(mask)} mask entries; pass one mask entry per target token")
    check_count(width, "width", "tokens per line")
    rows: list[list[tuple[str, float]]] = [[]]
    for tok, m in zip(tokens, mask):
        if len(rows[-1]) >= width:
            rows.append([])
        rows[-1].append((tok.replace("\n", "↵"), float(m)))
        if tok.endswith("\n"):
            rows.append([])
    return [r for r in rows if r]


def plot_datum_layout(tokens: Sequence[str], mask: Sequence[float], width: int = 64, ax: plt.Axes | None = None):
    """Draw a datum's target tokens as text, each on a cell coloured by its mask: the tokens the model sampled
    (mask 1, trained) in colour, the environment's tokens (mask 0, never trained) in grey. Returns the axes."""
    if len(tokens) == 0:
        raise ValueError("plot_datum_layout needs at least one target token; this datum has none.")
    rows = datum_rows(tokens, mask, width)
    cols = max(sum(max(len(t), 1) for t, _ in r) for r in rows)
    ax = ax if ax is not None else plt.subplots(figsize=(min(0.16 * cols + 1, 14), 0.32 * len(rows) + 0.8))[1]
    for y, row in enumerate(rows):
        x = 0
        for tok, m in row:
            w = max(len(tok), 1)
            ax.add_patch(plt.Rectangle((x, -y - 0.45), w, 0.9, color="tab:orange" if m else "0.88", lw=0))
            # parse_math=False: a token is text, and '$$' (a real tokenizer's token) failed to draw as maths
            ax.text(x + w / 2, -y, tok, ha="center", va="center", fontsize=7, family="monospace", parse_math=False)
            x += w
    ax.set_xlim(0, cols)
    ax.set_ylim(-len(rows) + 0.4, 0.6)
    ax.axis("off")
    ax.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color="tab:orange"), plt.Rectangle((0, 0), 1, 1, color="0.88")],
        labels=["model's tokens (mask 1)", "environment's tokens (mask 0)"],
        loc="upper left",
        bbox_to_anchor=(0, 0),
        ncol=2,
        fontsize=8,
        frameon=False,
    )
    return ax


def staleness_schedule(
    max_steps_off_policy: int, steps: int = 8, sample_seconds: float = 1.0, train_seconds: float = 1.0
) -> pd.DataFrame:
    """When each batch is sampled and trained, for a sampler ``max_steps_off_policy`` = k steps ahead of the
    trainer (:mod:`edurl.llm.off_policy`), with fixed durations. Batch s needs the weights of step max(0, s - k),
    which exist once the trainer has finished step s - k - 1; the sampler does one batch at a time, and so does the
    trainer. k = 0 is the synchronous loop. One row per batch: ``batch``, ``weights`` (the step whose weights
    sampled it), ``staleness``, ``sample_start``, ``sample_end``, ``train_start``, ``train_end`` (seconds)."""
    if not is_whole(max_steps_off_policy) or max_steps_off_policy < 0:
        raise ValueError(f"max_steps_off_policy must be an int >= 0, got {max_steps_off_policy!r}")
    if not is_whole(steps) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not all(isinstance(t, numbers.Real) and 0 < t < float("inf") for t in (sample_seconds, train_seconds)):
        raise ValueError(f"durations must be finite numbers > 0, got {sample_seconds!r} and {train_seconds!r}")
    k, rows, sampler_free, trainer_free, trained = max_steps_off_policy, [], 0.0, 0.0, {}
    for s in range(steps):
        weights = max(0, s - k)
        ready = trained.get(weights - 1, 0.0)  # weights w exist when step w - 1 is trained (w = 0: at the start)
        sample_start = max(sampler_free, ready)
        sampler_free = sample_start + sample_seconds
        train_start = max(trainer_free, sampler_free)
        trainer_free = trained[s] = train_start + train_seconds
        rows.append((s, weights, s - weights, sample_start, sampler_free, train_start, trainer_free))
    columns = ["batch", "weights", "staleness", "sample_start", "sample_end", "train_start", "train_end"]
    return pd.DataFrame(rows, columns=columns)


def plot_staleness_timeline(schedule: pd.DataFrame, ax: plt.Axes | None = None, title: str | None = None):
    """Draw a :func:`staleness_schedule` (or measured times in its columns): the sampler's batches on one row,
    labelled with the weights that sampled them, the trainer's on the other."""
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.8))
    colors = plt.get_cmap("tab10")
    for r in schedule.itertuples():
        color = colors(r.batch % 10)
        ax.barh(1, r.sample_end - r.sample_start, left=r.sample_start, color=color, alpha=0.55, edgecolor="k")
        ax.text(
            (r.sample_start + r.sample_end) / 2, 1, f"b{r.batch}\nw{r.weights}", ha="center", va="center", fontsize=8
        )
        ax.barh(0, r.train_end - r.train_start, left=r.train_start, color=color, alpha=0.9, edgecolor="k")
        ax.text((r.train_start + r.train_end) / 2, 0, f"b{r.batch}", ha="center", va="center", fontsize=8)
    ax.set_yticks([0, 1], ["trainer", "sampler"])
    ax.set_xlabel("time (s)")
    end = float(schedule["train_end"].iloc[-1])
    ax.set_title(title or f"{len(schedule)} steps in {end:.1f} s (b: batch, w: the step whose weights sampled it)")
    return ax
