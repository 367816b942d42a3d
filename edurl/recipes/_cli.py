"""Command-line overrides for the configs, from tyro: ``--field value`` for every field (nested ones as
``--sft.num-digits 3``), ``--flag`` / ``--no-flag`` for booleans, and ``--help`` with each field's docstring
and default."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import sys
import textwrap
from pathlib import Path

import tyro

from edurl.utils import device as _pick_device
from edurl.utils import file_in_the_way


def parse_config(cls, argv: list[str] | None = None, *, data_parallel: bool = False, **defaults):
    """Build ``cls`` from the command line (``sys.argv[1:]`` when ``argv`` is None); ``defaults`` override the
    class's own defaults (e.g. a recipe's ``log_dir``). Unknown or malformed flags exit with tyro's message;
    a value the config itself refuses exits with tyro's message too. A ``device`` field (at any depth) that names
    hardware this machine lacks (``--device cuda`` without CUDA), and a ``log_dir`` that is a file or lies under one, exit with the
    reason before anything is built or trained, and so does a recipe under torchrun (WORLD_SIZE > 1) unless it
    splits its batch across the ranks (``data_parallel``)."""
    config = tyro.cli(cls, args=argv, default=cls(**defaults) if defaults else None)
    world_size = os.environ.get("WORLD_SIZE", "1")
    if world_size.isdigit() and int(world_size) > 1 and not data_parallel:
        refuse(
            f"WORLD_SIZE={world_size}: this recipe runs in one process; under torchrun every rank would train the "
            "same run and write the same files. Run it with python -m; of the recipes, only grpo_arithmetic "
            "splits its batch across torchrun's ranks."
        )
    for flag, name in _device_fields(config):
        try:
            _pick_device(name)
        except ValueError as err:
            refuse(f"{flag} {name}: {err}")
    log_dir = getattr(config, "log_dir", None)
    clash = file_in_the_way(log_dir) if isinstance(log_dir, str) else None
    if clash is not None:
        refuse(f"--log-dir {log_dir}: {clash}; pass a folder (it is made if missing)")
    return config


def refuse(message: str) -> None:
    """End a recipe before any work with ``error: message`` and exit status 2, as tyro does for a bad flag."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _device_fields(config, prefix: str = "--"):
    """(flag, value) for every string ``device`` field of a dataclass config and of the dataclasses nested in it."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "device" and isinstance(value, str):
            yield prefix + "device", value
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from _device_fields(value, f"{prefix}{f.name.replace('_', '-')}.")


def field_docs(cls) -> dict[str, str]:
    """The docstring written under each field of a dataclass and its dataclass bases (STYLE.md's config
    convention, which tyro reads for ``--help``)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(getattr(nxt, "value", None), ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = nxt.value.value.strip()
    return docs


def draw_learning_curve(result, title: str):
    """A TrainResult's training-episode returns (rolling mean over the config's ``solve_window``, the mean the
    "solved" line and markers are judged on) against env steps; for a list of them (a
    trainer config's ``num_seeds`` > 1), their mean with the min-max band across seeds, over the steps every seed
    ran, and each seed's own curve, thin, over all of its steps: a seed still unsolved after the others stopped
    stays in view. When the seeds share no steps (one solved before another finished an episode) or a seed
    finished no episode, only the seeds' own curves are drawn, and the title says why. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    from edurl.plotting import plot_learning_curves, rolling_mean

    results = result if isinstance(result, list) else [result]
    window = results[0].config.solve_window  # the window "solved" is judged on: 100 episodes unless set otherwise
    curves = [r.episodes[["step", "episode_return"]].dropna().sort_values("step") for r in results]
    played = [c for c in curves if len(c)]
    shared = len(played) == len(curves) and max(c["step"].iloc[0] for c in curves) <= min(
        c["step"].iloc[-1] for c in curves
    )
    if shared:
        ax = plot_learning_curves({title: curves}, x="step", y="episode_return", window=window)
        color = ax.lines[-1].get_color()
    else:
        ax, color = plt.subplots(figsize=(7, 4))[1], "C0"
        ax.set_xlabel("env steps")
        ax.set_ylabel(f"episode_return (rolling mean of {window})")
        why = "no episode finished" if not played else "the seeds share no steps to average over"
        ax.set_title(f"{title}: {why}" + ("; train longer (total_steps)" if len(played) < len(curves) else ""))
    if len(results) > 1 or not shared:
        for i, ep in enumerate(played):
            label = "each seed" if i == 0 and len(results) > 1 else None
            ax.plot(ep["step"], rolling_mean(ep["episode_return"].to_numpy(float), window), color=color,
                    lw=0.6 if shared else 1.2, alpha=0.5 if shared else 1.0, label=label)  # fmt: skip
    ax.axhline(results[0].config.solve_threshold, color="gray", ls="--", lw=1, label="solved")
    for r in results:
        if r.solved:
            ax.axvline(r.solved_step, color="green", ls=":", lw=1)
    return ax


def save_learning_curve(result, path: Path, title: str) -> Path:
    """:func:`draw_learning_curve`, saved as a PNG at ``path``."""
    return save_figure(draw_learning_curve(result, title).figure, path, dpi=120, bbox_inches="tight")


def save_figure(fig, path, **savefig_kwargs) -> Path:
    """Write ``fig`` to ``path`` (its folder made) and close it, leaving matplotlib's backend as it is: a recipe's
    ``main()`` called from a notebook must not switch the notebook's inline figures off for the rest of the session
    (``matplotlib.use("Agg")`` here once did)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    clash = file_in_the_way(path.parent)
    if clash is not None:  # the figure stays open: save it again to another path
        raise NotADirectoryError(f"cannot save the figure to {str(path)!r}: {clash}. Pass a path in a folder.")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, **savefig_kwargs)
    finally:
        plt.close(fig)
    return path


def run_as_script(main) -> None:
    """``python -m edurl.recipes.NAME``: the figures only go to PNG files, so no window toolkit is needed (Agg);
    then ``main()``. Only a recipe's ``__main__`` calls this, never ``main()`` itself."""
    import matplotlib

    matplotlib.use("Agg")
    main()


def run_trainer_recipe(config_cls, train, name: str, argv=None):
    """Parse the command line (``--help`` lists the fields), train, write the learning curve PNG beside metrics.jsonl, report."""
    config = parse_config(config_cls, argv, log_dir=f"runs/{name.lower().replace(' ', '_')}_cartpole")
    result = train(config)
    # the PNG goes beside metrics.jsonl; with log_dir None (no logs) there is nowhere to put it
    png = (
        None
        if config.log_dir is None
        else save_learning_curve(result, Path(config.log_dir) / "learning_curve.png", name)
    )
    report(result, png)
    return result


def report(result, png: Path | None) -> None:
    """One line per seed (a list of results comes from a trainer config's ``num_seeds`` > 1), then the PNG's path
    (None: no log_dir, so none was saved)."""
    results = result if isinstance(result, list) else [result]
    for r in results:
        who = f"seed {r.config.seed}: " if len(results) > 1 else ""
        if r.solved:
            print(f"{who}solved after {r.solved_episode} episodes, {r.solved_step:,} env steps, {r.solved_time:.1f} s")
        elif len(r.episodes) == 0:
            print(f"{who}not solved: no episode finished (train longer: total_steps)")
        else:
            last = r.episodes["episode_return"].tail(r.config.solve_window)  # fewer in a short run
            print(f"{who}not solved: last {len(last)}-episode mean return {last.mean():.1f}")
    print(f"learning curve: {png}" if png is not None else "learning curve: not saved (log_dir is None)")
