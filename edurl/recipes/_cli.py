"""Command-line overrides for dataclass configs: ``--field value`` for every field, ``--help`` for their docs."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import types
import typing
from pathlib import Path


def field_docs(cls) -> dict[str, str]:
    """The docstring written under each field of a dataclass and its dataclass bases (STYLE.md's config convention)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                    and isinstance(getattr(nxt, "value", None), ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = nxt.value.value.strip()
    return docs


def _convert(name: str, text: str, annotation):
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if text.lower() == "none" and type(None) in args:
            return None
        annotation = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    try:
        if annotation is bool:
            if text.lower() in ("1", "true", "yes"):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
            raise ValueError
        if origin is tuple:
            return tuple(args[0](x) for x in text.split(",") if x)
        return annotation(text)
    except ValueError:
        raise SystemExit(f"--{name.replace('_', '-')}: cannot read {text!r} as {getattr(annotation, '__name__', annotation)}.")


def parse_config(cls, argv: list[str] | None = None, **defaults):
    """Build ``cls`` from ``--field value`` pairs (dashes or underscores). Unknown fields are an error."""
    argv = sys.argv[1:] if argv is None else argv
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if any(a in ("-h", "--help") for a in argv):
        docs = field_docs(cls)
        print(f"Fields of {cls.__name__} (override with --field value):\n")
        for name, f in fields.items():
            default = defaults.get(name, f.default)
            print(f"  --{name.replace('_', '-'):<22} {docs.get(name, '')} [default: {default}]")
        raise SystemExit(0)
    values = dict(defaults)
    it = iter(argv)
    for arg in it:
        if not arg.startswith("--"):
            raise SystemExit(f"expected --field value, got {arg!r}. Run with --help for the fields.")
        key, _, inline = arg[2:].partition("=")
        name = key.replace("-", "_")
        if name not in fields:
            raise SystemExit(f"unknown field --{key} for {cls.__name__}. Fields: {', '.join(fields)}.")
        text = inline if inline else next(it, None)
        if text is None:
            raise SystemExit(f"--{key} needs a value.")
        values[name] = _convert(name, text, hints[name])
    return cls(**values)


def save_learning_curve(result, path: Path, title: str) -> Path:
    """Plot a TrainResult's training-episode returns (rolling mean of 100) against env steps and save a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edurl.plotting import plot_learning_curves

    ax = plot_learning_curves({title: [result.episodes]}, x="step", y="episode_return", window=100)
    ax.axhline(result.config.solve_threshold, color="gray", ls="--", lw=1, label="solved")
    if result.solved:
        ax.axvline(result.solved_step, color="green", ls=":", lw=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    ax.figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(ax.figure)
    return path


def run_trainer_recipe(config_cls, train, name: str, argv=None):
    """Parse ``--field value`` overrides, train, write the learning curve PNG beside metrics.jsonl, report."""
    config = parse_config(config_cls, argv, log_dir=f"runs/{name.lower().replace(' ', '_')}_cartpole")
    result = train(config)
    png = save_learning_curve(result, Path(config.log_dir) / "learning_curve.png", name)
    report(result, png)
    return result


def report(result, png: Path) -> None:
    if result.solved:
        print(f"solved after {result.solved_episode} episodes, {result.solved_step:,} env steps, "
              f"{result.solved_time:.1f} s")
    else:
        tail = result.episodes["episode_return"].tail(result.config.solve_window).mean()
        print(f"not solved: last {result.config.solve_window}-episode mean return {tail:.1f}")
    print(f"learning curve: {png}")
