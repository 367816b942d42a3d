"""``metrics.jsonl``: one JSON object per step, written as the run goes, read back with one call.

Every training loop in the course logs through :class:`MetricsLogger`, and every notebook reads
the file back with :func:`load_metrics`. Names follow the Tinker Cookbook's where one exists
(``env/all/reward/total``, ``optim/entropy``, ``time/...``; see COURSE.md).
"""

from __future__ import annotations

import json
import numbers
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from edurl._checks import is_whole
from edurl.utils import file_in_the_way, warn_at_caller

__all__ = ["MetricsLogger", "load_metrics", "truncate_metrics"]

_IF_EXISTS = ("error", "append", "overwrite")


def _to_json_value(key: str, value):
    """Turn a scalar metric into something ``json`` writes; reject what a table cannot hold."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"metric {key!r} is a tensor of shape {tuple(value.shape)}; log a scalar, e.g. x.mean().item()."
            )
        value = value.item()
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalars and 0-d arrays
        try:
            value = value.item()
        except (ValueError, TypeError):
            pass
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)  # NaN and inf are kept: json writes NaN/Infinity and load_metrics reads them back
    raise TypeError(
        f"metric {key!r} has type {type(value).__name__}; log numbers, bools or strings, one scalar per name."
    )


class MetricsLogger:
    """Append one JSON object per step to ``log_dir/metrics.jsonl``.

    Each line holds ``step``, the metrics given, and ``time/total``: seconds since the logger was
    made (plus the last ``time/total`` already in the file when appending), so curves can be drawn
    against wall time. Each line goes to the file in one unbuffered write, so a crash, or a kill at any
    moment, keeps every logged step and never leaves half a line.

    ``if_exists`` says what to do when the file is already there: ``"error"`` (the default, so a
    rerun never silently mixes two runs), ``"append"`` (resume) or ``"overwrite"``.

    >>> logger = MetricsLogger("runs/demo", if_exists="overwrite")
    >>> logger.log(step=0, **{"env/all/reward/total": 0.5})
    """

    def __init__(self, log_dir: str | Path, *, if_exists: str = "error"):
        if if_exists not in _IF_EXISTS:
            raise ValueError(f"if_exists must be one of {_IF_EXISTS}, got {if_exists!r}.")
        self.log_dir = Path(log_dir)
        clash = file_in_the_way(self.log_dir)  # was a bare "[Errno 17] File exists" or "[Errno 20] Not a directory"
        if clash is not None:
            raise NotADirectoryError(
                f"log_dir {clash}; a MetricsLogger writes <log_dir>/metrics.jsonl, so pass a folder (new or existing)."
            )
        self.path = self.log_dir / "metrics.jsonl"
        self._time_offset = 0.0
        if self.path.exists() and self.path.stat().st_size > 0:
            if if_exists == "error":
                raise FileExistsError(
                    f"{self.path} already holds a run. Pass if_exists='append' to resume it, "
                    "if_exists='overwrite' to replace it, or choose another log_dir."
                )
            if if_exists == "append":
                previous = load_metrics(self.path)
                if "time/total" in previous and previous["time/total"].notna().any():
                    self._time_offset = float(previous["time/total"].dropna().iloc[-1])
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab" if if_exists == "append" else "wb", buffering=0)  # one write() per line
        if if_exists == "append" and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a file written without a last newline: the next record needs its own line
                    self._file.write(b"\n")
        self._start = time.perf_counter()

    def log(self, step: int, **metrics) -> dict:
        """Write one line: ``{"step": step, **metrics, "time/total": seconds}``. Returns the record.

        Metric names may contain ``/``; pass them with ``**{"optim/entropy": x}``. Every value is
        checked before anything is written, so a bad value never leaves a half-written line.
        """
        if not is_whole(step):
            raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}.")
        if self._file.closed:
            raise ValueError(
                f"this logger is closed; make a new MetricsLogger({str(self.log_dir)!r}, if_exists='append')."
            )
        record = {"step": int(step)}
        for key, value in metrics.items():
            record[key] = _to_json_value(key, value)
        record.setdefault("time/total", self._time_offset + time.perf_counter() - self._start)
        self._file.write((json.dumps(record) + "\n").encode("utf-8"))
        return record

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def truncate_metrics(log_dir: str | Path, before_step: int) -> int:
    """Keep only the lines of ``log_dir/metrics.jsonl`` with ``step < before_step``: what a run resumed from
    the checkpoint of step ``before_step`` must not log twice. A last line without its newline (a write cut
    short) is dropped too. The file is replaced in one rename, so a kill leaves the old or the new file,
    never a mix. Returns the number of lines kept."""
    if not is_whole(before_step):
        raise ValueError(
            f"before_step must be the step (an int) of the checkpoint the run resumes from, got {before_step!r}."
        )
    path = Path(log_dir) / "metrics.jsonl"
    lines = path.read_text(encoding="utf-8").split("\n")[:-1] if path.exists() else []  # complete lines only
    kept = []
    for lineno, line, record in _records(path, lines):
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(
                f"{path}, line {lineno}, is not a metrics record with a 'step' ({line[:80]!r}); the file was not "
                "written by a MetricsLogger, or was edited. Fix or remove that line, then resume again."
            )
        if record["step"] < before_step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
    return len(kept)


def load_metrics(path: str | Path) -> pd.DataFrame:
    """Read ``metrics.jsonl`` (or a folder holding one) into a DataFrame, one row per line.

    NaN and infinities that were logged come back as NaN and ±inf. Blank lines are skipped;
    a line that is not JSON raises ``ValueError`` naming the file and line.
    """
    path = Path(path)
    if path.is_dir():
        top, seeds = path / "metrics.jsonl", sorted(path.glob("seed*/metrics.jsonl"))
        if seeds and not top.exists():
            raise FileNotFoundError(
                f"{path} holds a run of several seeds (num_seeds > 1), one folder each "
                f"({', '.join(s.parent.name for s in seeds[:3])}{', ...' if len(seeds) > 3 else ''}): load one of "
                f"them, e.g. load_metrics({str(seeds[0].parent)!r})"
            )
        if top.exists() and any(s.stat().st_mtime > top.stat().st_mtime for s in seeds):
            warn_at_caller(
                f"{top} is older than the seed folders beside it ({seeds[0].parent.name}, ...), which a later run "
                "with num_seeds > 1 wrote into the same log_dir: this is the earlier run's file. Load a seed's "
                f"folder for the later run, e.g. load_metrics({str(seeds[0].parent)!r})",
            )
        path = top
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {path}; a MetricsLogger writes <log_dir>/metrics.jsonl.")
    with open(path, encoding="utf-8") as f:
        records = []
        for lineno, line, record in _records(path, f):
            if not isinstance(record, dict):  # null or 3 failed inside pandas; a list loaded as columns 0 and 1
                raise ValueError(
                    f'{path}, line {lineno} is JSON but not a record ({{"step": ..., ...}}): {line[:80]!r}'
                )
            records.append(record)
        return pd.DataFrame.from_records(records)


def _records(path: Path, lines) -> Iterator[tuple[int, str, Any]]:
    """``(line number, line, parsed JSON)`` for each non-blank line of the metrics file ``path``; a line that is not
    JSON raises ``ValueError`` naming the file and line."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {lineno} is not valid JSON ({err.msg}): {line[:80]!r}") from None
        yield lineno, line, record
