import pytest
import torch

from edurl.llm.model import TinyLMConfig, build_tiny_lm, num_parameters

from .conftest import SMALL


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_vocabulary_seed_and_sizes(char_tokenizer, arch):
    config = TinyLMConfig(**{**SMALL.__dict__, "arch": arch})
    a, b = build_tiny_lm(char_tokenizer, config, seed=3), build_tiny_lm(char_tokenizer, config, seed=3)
    c = build_tiny_lm(char_tokenizer, config, seed=4)
    ids = torch.tensor([char_tokenizer.encode("12 + 34=?")])
    logits = a(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(char_tokenizer))
    assert torch.equal(logits, b(input_ids=ids).logits) and not torch.equal(logits, c(input_ids=ids).logits)
    assert a.config.pad_token_id == char_tokenizer.pad_token_id and not a.training


def test_build_does_not_touch_the_global_rng(char_tokenizer):
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    build_tiny_lm(char_tokenizer, SMALL, seed=5)
    assert torch.equal(torch.rand(1), expected)


def test_num_parameters_counts_tied_embeddings_once(char_tokenizer):
    model = build_tiny_lm(char_tokenizer, SMALL)
    V, H, L, F = len(char_tokenizer), SMALL.hidden_size, SMALL.num_layers, SMALL.intermediate_size
    # embeddings (tied with the output layer) + per block: q, k, v, o (H x H each), 3 MLP matrices, 2 norms; final norm
    assert num_parameters(model) == V * H + L * (4 * H * H + 3 * H * F + 2 * H) + H


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"arch": "gpt2"}, "arch must be one of"),
        ({"hidden_size": 30, "num_heads": 4}, "divisible by num_heads"),
        # a head of 3 dimensions built, then failed in the rotary code of the first forward pass
        ({"hidden_size": 6, "num_heads": 2}, "hidden_size / num_heads = 3 dimensions.*must be even"),
    ],
)
def test_bad_configs_say_why(char_tokenizer, kw, message):
    with pytest.raises(ValueError, match=message):
        build_tiny_lm(char_tokenizer, TinyLMConfig(**kw))
