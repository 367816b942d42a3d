import pytest
import torch

from edurl.llm.padding import pad


def test_right_and_left_padding_by_hand():
    ids, mask = pad([[5, 6, 7], [8]], 0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    ids, mask = pad([[5, 6, 7], [8]], -1, side="left")
    assert ids.tolist() == [[5, 6, 7], [-1, -1, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_floats_tensors_and_a_fixed_length():
    x, mask = pad([torch.tensor([0.5, -1.0]), [2.0]], 0, dtype=torch.float32, length=4)
    assert x.dtype == torch.float32 and x.tolist() == [[0.5, -1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]]
    assert mask.dtype == torch.long and mask.sum().item() == 3


def test_bad_inputs_say_what_to_do():
    with pytest.raises(ValueError, match="side must be"):
        pad([[1]], 0, side="middle")
    with pytest.raises(ValueError, match="length=1 is shorter"):
        pad([[1, 2]], 0, length=1)
    with pytest.raises(ValueError, match="at least one row"):
        pad([], 0)
    # the default dtype is for token ids: float rows were truncated, 0.7 to 0 and 1.9 to 1, without a word
    for rows in ([[0.7, 1.9], [2.5]], [torch.tensor([0.7, 1.0])], [torch.tensor([1.0]), [0.5]]):
        with pytest.raises(ValueError, match="fractional value.*dtype=torch.float32"):
            pad(rows, 0)
    assert pad([[1.0, 2.0], torch.tensor([3.0])], 0)[0].tolist() == [[1, 2], [3, 0]]  # whole floats are ids
    with pytest.raises(ValueError, match=r"one-dimensional rows, got rows of shape \(3, 1\)"):
        pad([torch.zeros(3, 1, dtype=torch.long)], 0)


def test_float64_lists_keep_float64():
    x, _ = pad([[0.1, 0.2], [1 / 3]], 0.0, dtype=torch.float64)
    assert x.dtype == torch.float64 and x[1, 0].item() == 1 / 3


def _pad_row_by_row(rows, pad_value, side, dtype, length):
    """The slow reference: one row at a time, as pad did before its single masked write."""
    out = torch.full((len(rows), length), pad_value, dtype=dtype)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row)
        cols = slice(0, n) if side == "right" else slice(length - n, length)
        out[i, cols] = torch.as_tensor(row, dtype=dtype) if not isinstance(row, torch.Tensor) else row.to(dtype)
        mask[i, cols] = 1
    return out, mask


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("kind", ["tensors", "lists", "mixed"])
@pytest.mark.parametrize("dtype", [torch.long, torch.float32])
def test_matches_a_row_by_row_reference(side, kind, dtype):
    g = torch.Generator().manual_seed(0)
    lengths = [0, 3, 1, 7, 0, 5, 7, 2]  # empty rows, ties for the longest, a one-token row
    rows = [torch.randint(1, 50, (n,), generator=g).to(dtype) for n in lengths]
    if kind == "lists":
        rows = [r.tolist() for r in rows]
    elif kind == "mixed":
        rows = [r.tolist() if i % 2 else r for i, r in enumerate(rows)]
    for length in (None, 9):
        want = _pad_row_by_row(rows, -3, side, dtype, length or max(lengths))
        got = pad(rows, -3, side=side, dtype=dtype, length=length)
        assert got[0].dtype == dtype and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_all_rows_empty():
    ids, mask = pad([[], []], 0)
    assert ids.shape == (2, 0) and mask.shape == (2, 0)
