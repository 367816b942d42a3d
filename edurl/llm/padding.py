"""One way to pad rows of different lengths into a batch, used by the sampler, the trainer and SFT.

::

    pad([[5, 6, 7], [8]], 0)               ->  ids [[5, 6, 7], [8, 0, 0]],  mask [[1, 1, 1], [1, 0, 0]]
    pad([[5, 6, 7], [8]], 0, side="left")  ->  ids [[5, 6, 7], [0, 0, 8]],  mask [[1, 1, 1], [0, 0, 1]]

Right padding keeps position t of every row at column t (training batches: targets line up with inputs).
Left padding makes every row end in the last column (sampling: each next token is appended at the same column).
"""

from __future__ import annotations

from collections.abc import Sequence

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
    out = torch.full((len(rows), length), pad_value, dtype=dtype, device="cpu")
    mask = torch.zeros((len(rows), length), dtype=torch.long, device="cpu")
    for i, row in enumerate(rows):
        n = len(row)
        cols = slice(0, n) if side == "right" else slice(length - n, length)
        out[i, cols] = (
            torch.as_tensor(row, dtype=dtype, device="cpu")
            if not isinstance(row, torch.Tensor)
            else row.to("cpu", dtype)
        )
        mask[i, cols] = 1
    return (out, mask) if device is None else (out.to(device), mask.to(device))
