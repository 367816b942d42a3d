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
