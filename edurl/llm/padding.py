"""One way to pad rows of different lengths into a batch, used by the sampler, the trainer and SFT.

::

    pad([[5, 6, 7], [8]], 0)               ->  ids [[5, 6, 7], [8, 0, 0]],  mask [[1, 1, 1], [1, 0, 0]]
    pad([[5, 6, 7], [8]], 0, side="left")  ->  ids [[5, 6, 7], [0, 0, 8]],  mask [[1, 1, 1], [0, 0, 1]]

Right padding keeps position t of every row at column t (training batches: targets line up with inputs).
Left padding makes every row end in the last column (sampling: each next token is appended at the same column).
"""

from __future__ import annotations

import numbers
from array import array
from collections.abc import Sequence
from itertools import chain

import torch

__all__ = ["pad"]


def pad(
    rows: Sequence[Sequence[float] | torch.Tensor],
    pad_value: float = 0,
    *,
    side: str = "right",
    dtype: torch.dtype = torch.long,
    device: str | torch.device | None = None,
    length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``rows`` into a (B, T) tensor of ``dtype`` filled with ``pad_value`` where a row has no entry, and
    its (B, T) long mask (1 on real entries). T is the longest row, or ``length`` if given (>= every row).

    The batch is built on the CPU and moved to ``device`` in one copy.
    """
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}.")
    if not len(rows):
        raise ValueError("pad needs at least one row.")
    longest = max(len(r) for r in rows)
    length = longest if length is None else length
    if length < longest:
        raise ValueError(
            f"length={length} is shorter than the longest row ({longest}); pass length >= {longest} or None."
        )
    # one flat copy of every entry, then one masked write: a per-row Python loop of tensor ops cost about 10 us a
    # row, which a GRPO step (256 datums, several fields) paid a few thousand times (benchmarks/README.md)
    if all(isinstance(row, torch.Tensor) for row in rows):
        flat = torch.cat(list(rows)) if all(row.dim() == 1 for row in rows) else None
        if flat is None:
            shapes = sorted({tuple(row.shape) for row in rows if row.dim() != 1})
            raise ValueError(f"pad takes one-dimensional rows, got rows of shape {shapes[0]}")
        _check_whole(flat, dtype)
        flat = flat.to("cpu", dtype)
        counts = [row.shape[0] for row in rows]
    else:
        counts = [len(row) for row in rows]
        plain_ints = dtype == torch.long and not any(isinstance(row, torch.Tensor) for row in rows)
        flat = _ints(rows) if plain_ints else None
        if flat is None:
            entries = [x for row in rows for x in (row.tolist() if isinstance(row, torch.Tensor) else row)]
            if not (dtype.is_floating_point or dtype.is_complex):  # an integer dtype would truncate 0.7 to 0
                fractional = next((x for x in entries if _fractional(x)), None)
                if fractional is not None:
                    raise ValueError(_TRUNCATES.format(value=fractional, dtype=dtype))
            flat = torch.tensor(entries, dtype=dtype, device="cpu") if entries else torch.zeros(0, dtype=dtype)
    lengths = torch.tensor(counts, device="cpu")
    col = torch.arange(length, device="cpu")[None]  # (1, T)
    real = col < lengths[:, None] if side == "right" else col >= length - lengths[:, None]  # (B, T)
    out = torch.full((len(rows), length), pad_value, dtype=dtype, device="cpu")
    out[real] = flat  # row-major order: row 0's entries, then row 1's, ... as in ``flat``
    mask = real.long()
    return (out, mask) if device is None else (out.to(device), mask.to(device))


def _check_whole(values: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse fractional values for an integer ``dtype``, which the cast would truncate (0.7 to 0): pad's default
    dtype is for token ids, so float rows (log-probs, advantages) need ``dtype=torch.float32``."""
    if values.is_floating_point() and not (dtype.is_floating_point or dtype.is_complex):
        fractional = values[values != values.trunc()]
        if fractional.numel():
            raise ValueError(_TRUNCATES.format(value=fractional[0].item(), dtype=dtype))


_TRUNCATES = (
    "the rows hold a fractional value ({value!r}) and dtype is {dtype}, which would truncate it (0.7 to 0); pass "
    "dtype=torch.float32 for log-probs, advantages or weights"
)


def _fractional(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, numbers.Integral) and not float(x).is_integer()


def _ints(rows: Sequence[Sequence[int]]) -> torch.Tensor | None:
    """Every entry of ``rows`` in one long tensor, through an array of ints (several times faster than a list of
    Python ints), or None when there are none or some entry is not an int (``pad``'s general path handles it)."""
    try:
        values = array("q", chain.from_iterable(rows))
    except (TypeError, OverflowError):
        return None
    return torch.frombuffer(values, dtype=torch.long) if values else None
