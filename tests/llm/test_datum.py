import pytest
import torch

from edurl.llm.datum import Datum, ModelInput, build_datum, build_datums, build_supervised_datum


def test_layout_hand_computed():
    d = build_datum([10, 11, 12], [20, 21], [-0.5, -0.25], advantage=2.0)
    assert d.model_input.to_ints() == [10, 11, 12, 20]
    f = d.loss_fn_inputs
    assert f["target_tokens"].tolist() == [11, 12, 20, 21]
    assert f["logprobs"].tolist() == [0.0, 0.0, -0.5, -0.25]
    assert f["advantages"].tolist() == [0.0, 0.0, 2.0, 2.0]
    assert f["mask"].tolist() == [0.0, 0.0, 1.0, 1.0]


def test_one_token_prompt():
    d = build_datum([7], [8, 9], [-1.0, -2.0], advantage=-1.0)
    assert d.model_input.to_ints() == [7, 8]
    assert d.loss_fn_inputs["advantages"].tolist() == [-1.0, -1.0]


def test_errors():
    with pytest.raises(ValueError, match="prompt_tokens is empty"):
        build_datum([], [1], [0.0], 1.0)
    with pytest.raises(ValueError, match="one log-prob per sampled token"):
        build_datum([1], [2, 3], [0.0], 1.0)
    with pytest.raises(ValueError, match=r"has shape \(3,\), but model_input has 2 tokens"):
        Datum(ModelInput.from_ints([1, 2]), {"advantages": torch.zeros(3)})
    with pytest.raises(TypeError, match="int token ids"):
        ModelInput.from_ints([1.5])


def test_build_datums_equals_build_datum_one_by_one():
    gen = torch.Generator().manual_seed(0)
    prompts, completions, logprobs, advantages = [], [], [], []
    for i in range(40):  # prompts of 1-6 tokens, completions of 0-5, as a GRPO batch has (never both empty-ish)
        n_prompt, n = 1 + (i + 1) % 6, i % 6
        prompts.append(torch.randint(0, 100, (n_prompt,), generator=gen).tolist())
        completions.append(torch.randint(0, 100, (n,), generator=gen).tolist())
        logprobs.append((-torch.rand(n, generator=gen)).tolist())
        advantages.append(float(torch.randn(1, generator=gen)))
    bulk = build_datums(prompts, completions, logprobs, advantages)
    one_by_one = [build_datum(*args) for args in zip(prompts, completions, logprobs, advantages)]
    assert len(bulk) == 40
    for a, b in zip(bulk, one_by_one):
        assert a.model_input == b.model_input
        assert list(a.loss_fn_inputs) == list(b.loss_fn_inputs)
        for key, value in b.loss_fn_inputs.items():
            assert a.loss_fn_inputs[key].dtype == value.dtype
            assert torch.equal(a.loss_fn_inputs[key], value)
    assert build_datums([], [], [], []) == []


def test_build_datums_errors():
    with pytest.raises(ValueError, match="prompt_tokens is empty"):
        build_datums([[1], []], [[2], [1]], [[0.0], [0.0]], [1.0, 1.0])
    with pytest.raises(ValueError, match="one log-prob per sampled token"):
        build_datums([[1]], [[2, 3]], [[0.0]], [1.0])
    with pytest.raises(ValueError, match="one of each per datum"):
        build_datums([[1]], [[2]], [[0.0]], [1.0, 2.0])
    with pytest.raises(TypeError, match="token ids must be ints"):
        build_datums([[1]], [[2.5]], [[0.0]], [1.0])
    with pytest.raises(TypeError, match="token ids must be ints"):
        build_datums([[1.0]], [[]], [[]], [1.0])  # a float first token, which no target holds


def test_build_datums_gives_int_ids_and_the_default_dtype_as_build_datum_does():
    # NumPy and torch ids stayed NumPy and torch objects in the ModelInput (json.dumps failed on them), and under a
    # float64 default the float fields were float32 where build_datum's were float64
    import json

    import numpy as np

    bulk = build_datums([np.array([1, 2])], [torch.tensor([3, 4])], [[-0.5, -0.25]], [1.0])[0]
    assert bulk.model_input.tokens == (1, 2, 3) and all(type(t) is int for t in bulk.model_input.tokens)
    json.dumps(bulk.model_input.tokens)
    assert bulk.model_input == build_datum([1, 2], [3, 4], [-0.5, -0.25], 1.0).model_input
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        one, bulk = build_datum([1], [2], [-0.1], 0.5), build_datums([[1]], [[2]], [[-0.1]], [0.5])[0]
    finally:
        torch.set_default_dtype(before)
    for key, value in one.loss_fn_inputs.items():
        assert bulk.loss_fn_inputs[key].dtype == value.dtype and torch.equal(bulk.loss_fn_inputs[key], value), key


def test_a_datum_with_no_positions_is_refused():
    # forward_backward on it failed with "argmax(): Expected reduction dim 1 to have non-zero size"
    with pytest.raises(ValueError, match="model_input is empty"):
        build_datum([3], [], [], 1.0)
    with pytest.raises(ValueError, match="model_input is empty"):
        build_datums([[3]], [[]], [[]], [1.0])
    assert build_datum([3, 4], [], [], 1.0).loss_fn_inputs["mask"].tolist() == [0.0]  # a prompt position is one


def test_supervised_layout_hand_computed():
    d = build_supervised_datum([10, 11, 12, 20, 21], [0, 0, 0, 1, 1])
    assert d.model_input.to_ints() == [10, 11, 12, 20]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [11, 12, 20, 21]
    assert d.loss_fn_inputs["weights"].tolist() == [0.0, 0.0, 1.0, 1.0]  # the weight of each target
    with pytest.raises(ValueError, match="one weight per token"):
        build_supervised_datum([1, 2, 3], [0, 1])
    with pytest.raises(ValueError, match="at least two tokens"):
        build_supervised_datum([1], [1])
