"""Argument types for the benchmarks' command lines: a bad value is argparse's one-line error (what was wrong, with
the script's usage), not a traceback from inside the run, and it comes before any work."""

from __future__ import annotations

import argparse


def seed_list(text: str) -> list[int]:
    """``--seeds 0,1,2``: comma-separated seeds, each an int >= 0, at least one, none twice."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of seeds: write ints >= 0 separated by commas, e.g. 0,1,2 (no spaces, no '...')"
        )
    seeds = [int(p) for p in parts]
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r} names a seed twice; each seed runs once")
    return seeds


def positive_int(text: str) -> int:
    """A count that must be at least 1 (steps, seeds, repeats, cores)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def seed_count(text: str) -> int:
    """``--seeds N`` in the scripts that run seeds 0 .. N-1 (cartpole.py, cartpole_pg.py, length_bias.py,
    assert_margins.py). Most other scripts take a list, so a list here is named as such, with the count to write."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 1 and all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a list of seeds, but --seeds here is how many seeds to run (0 .. N-1): for {len(parts)} "
            f"seeds write --seeds {len(parts)}, which runs seeds 0 .. {len(parts) - 1}"
        )
    return positive_int(text)


def seed_lists(parser: argparse.ArgumentParser, texts: list[list[int]]) -> list[int]:
    """Join ``--seeds`` given as ``nargs="+"`` of :func:`seed_list` (``0 1 2`` or ``0,1,2``) into one list."""
    seeds = [s for part in texts for s in part]
    if len(set(seeds)) != len(seeds):
        parser.error(f"argument --seeds: {seeds} names a seed twice; each seed runs once")
    return seeds
