"""The sampler's layer-by-layer decode step (edurl.llm.decode) against the model's own forward with its cache."""

import copy

import pytest
import torch
from transformers import DynamicCache

from edurl.llm.decode import GroupKV, fast_decoder
from edurl.llm.policy import wrap_lora
from edurl.llm.sampling import PrefixCache, SamplingParams, _layer_kv, sample
from edurl.llm.shared_prefix import CACHE_ARG

from .conftest import random_llama_family as _model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def _prefill(model, prompts=PROMPTS):
    """Left-padded prefill with the model's forward; returns (cache, mask, positions, last logits)."""
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{CACHE_ARG: cache})
    return cache, mask, pos, out.logits[:, -1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("G", [1, 3])
def test_decode_steps_give_the_models_logits(arch, dtype, tol, G):
    """Five steps of fed-back tokens for G samples of each prompt, with rows dropped after the second step: the
    same logits as the model's forward on its own cache (float64: to 1e-10, so the arithmetic is the same, not
    just close), and the same keys and values, row by row."""
    model = _model(arch, dtype)
    cache, mask, pos, _ = _prefill(model)
    decoder = fast_decoder(model)
    assert isinstance(decoder, GroupKV)
    decoder.load([_layer_kv(cache, i) for i in range(len(cache))], mask, G, room=5)
    cache.batch_repeat_interleave(G)
    mask, next_pos = mask.repeat_interleave(G, 0), pos[:, -1].repeat_interleave(G) + 1
    g = torch.Generator().manual_seed(0)
    for t in range(5):
        tokens = torch.randint(2, 50, (len(next_pos),), generator=g)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        want = model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=next_pos[:, None],
            use_cache=True,
            **{CACHE_ARG: cache},
        ).logits[:, -1]
        got = decoder.step(tokens, next_pos)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        next_pos = next_pos + 1
        if t == 1:  # some rows finish (a whole group among them when G = 1): both caches keep the rest
            keep = torch.arange(len(next_pos))[torch.arange(len(next_pos)) % 3 != 1]
            cache.batch_select_indices(keep)
            decoder.select(keep)
            mask, next_pos = mask[keep], next_pos[keep]
    for r in range(len(next_pos)):  # each row's keys and values are the cache's, on its real columns
        real = mask[r].bool()
        for (k, v), i in zip(decoder.row_kv(r), range(len(cache))):
            k2, v2 = _layer_kv(cache, i)
            torch.testing.assert_close(k[:, real], k2[r][:, real], atol=tol, rtol=tol)
            torch.testing.assert_close(v[:, real], v2[r][:, real], atol=tol, rtol=tol)


def test_a_full_buffer_refuses_another_step():
    model = _model("llama")
    cache, mask, pos, _ = _prefill(model)
    decoder = fast_decoder(model)
    decoder.load([_layer_kv(cache, i) for i in range(len(cache))], mask, 1, room=1)
    decoder.step(torch.tensor([2, 3, 4]), pos[:, -1] + 1)
    with pytest.raises(RuntimeError, match="full"):
        decoder.step(torch.tensor([2, 3, 4]), pos[:, -1] + 2)


def _draws(model, fast: bool, **kw):
    params = SamplingParams(max_tokens=8, temperature=1.0, stop=[[3]], seed=0)
    return sample(model, PROMPTS, 4, params, pad_token_id=0, fast_decode=fast, **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sample_draws_the_same_with_and_without_the_fast_decode(arch):
    model = _model(arch, torch.float64)
    slow, fast = _draws(model, False), _draws(model, True)
    assert any(c.stop_reason == "stop" for c in fast) and any(c.stop_reason == "length" for c in fast)
    for a, b in zip(slow, fast, strict=True):
        assert (a.tokens, a.stop_reason, a.prompt_index) == (b.tokens, b.stop_reason, b.prompt_index)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-10)


def test_the_fast_decode_runs_lora_adapters():
    """peft's LoRA layers sit in the projections the decode step calls, so an adapter changes the draws the same
    way on both paths."""
    model = wrap_lora(_model("qwen2"), 4)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # a nonzero adapter (lora_B starts at 0)
            torch.nn.init.normal_(p, std=0.5)
    assert fast_decoder(model) is not None
    slow, fast = _draws(model, False), _draws(model, True)
    for a, b in zip(slow, fast, strict=True):
        assert a.tokens == b.tokens
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    with model.disable_adapter():
        base = _draws(model, True)
    assert [c.tokens for c in base] != [c.tokens for c in fast]


def test_the_fast_decode_keeps_a_prefix_cache():
    """A multi-turn prefix cache stores the buffers' keys and values: turn 2 draws the same on both paths."""
    model = _model("llama", torch.float64)
    turns = {}
    for fast in (False, True):
        cache = PrefixCache()
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=1)
        first = sample(model, PROMPTS, 1, params, 0, [], cache, [0, 1, 2], fast_decode=fast)
        second = [p + c.tokens + [20, 21][: 1 + i % 2] for i, (p, c) in enumerate(zip(PROMPTS, first))]
        out = sample(model, second, 1, SamplingParams(max_tokens=6, seed=2), 0, [], cache, [0, 1, 2], fast_decode=fast)
        assert cache.hits == 3
        turns[fast] = (first, out)
    for a, b in zip(turns[False][0] + turns[False][1], turns[True][0] + turns[True][1], strict=True):
        assert a.tokens == b.tokens
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-10)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
        dict(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=4),
    ],
    ids=["scaled rotary", "sliding window"],
)
def test_models_it_does_not_know_keep_their_forward(overrides):
    arch = "qwen2" if "sliding_window" in overrides else "llama"
    model = _model(arch, **overrides)
    assert fast_decoder(model) is None
    out = _draws(model, True)  # and sampling still works, through the model's forward
    assert len(out) == 12


def test_an_extra_module_in_attention_keeps_the_forward():
    """An attention with parts the decode step would skip (e.g. Qwen3's q/k norms) is not run layer by layer."""
    model = copy.deepcopy(_model("llama"))
    model.model.layers[0].self_attn.q_norm = torch.nn.Identity()
    assert fast_decoder(model) is None


def test_an_attention_without_its_scale_keeps_the_forward():
    """transformers releases before 4.48 (the course allows >= 4.45) keep no ``scaling`` on the attention module."""
    model = copy.deepcopy(_model("llama"))
    del model.model.layers[1].self_attn.scaling
    assert fast_decoder(model) is None


def _five_steps(model, G: int, fast: bool) -> torch.Tensor:
    """The logits of five fed-back tokens per row, (5, rows, vocab) in float64, from the decode step or the forward."""
    cache, mask, pos, _ = _prefill(model)
    decoder = fast_decoder(model) if fast else None
    if fast:
        decoder.load([_layer_kv(cache, i) for i in range(len(cache))], mask, G, room=5)
    cache.batch_repeat_interleave(G)
    mask, next_pos = mask.repeat_interleave(G, 0), pos[:, -1].repeat_interleave(G) + 1
    g = torch.Generator().manual_seed(0)
    logits = []
    for _ in range(5):
        tokens = torch.randint(2, 50, (len(next_pos),), generator=g)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        if fast:
            logits.append(decoder.step(tokens, next_pos))
        else:
            out = model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                use_cache=True,
                **{CACHE_ARG: cache},
            )
            logits.append(out.logits[:, -1])
        next_pos = next_pos + 1
    return torch.stack(logits).double()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("lora", [False, True])
def test_the_fast_decode_is_as_accurate_as_the_forward_in_bfloat16(arch, lora):
    """In bf16, the GPU checks' dtype (with a LoRA adapter, whose weights peft keeps in float32), the two paths
    round differently, so neither is the reference: the same weights run in float64 are. The decode step's logits
    must be about as close to those as the model's own bf16 forward is (measured on one CPU: 0.85 to 1.26 times
    its error over the four cases; the bound of 2 leaves room for other CPUs' bf16 kernels)."""
    model = _model(arch, torch.bfloat16)
    if lora:
        model = wrap_lora(model, 4)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    exact = copy.deepcopy(model).double()  # every bf16 and float32 weight is exact in float64
    with torch.no_grad():
        truth = _five_steps(exact, 3, fast=False)
        forward_error = (_five_steps(model, 3, fast=False) - truth).abs().max()
        decode_error = (_five_steps(model, 3, fast=True) - truth).abs().max()
    assert forward_error > 0  # bf16 did round
    assert decode_error <= 2 * forward_error, (float(decode_error), float(forward_error))


@pytest.mark.parametrize("G", [1, 2])
def test_completion_buffers_start_small_and_grow_past_their_first_room(G, monkeypatch):
    # room for max_tokens up front held memory that rows stopping early never use (a fuzz run with max_tokens
    # 2e7 ran out of memory only on this path); now the buffers double as the completions grow
    model = _model("qwen2", torch.float64)
    cache, mask, _, _ = _prefill(model)
    decoder = fast_decoder(model)
    decoder.load([_layer_kv(cache, i) for i in range(len(cache))], mask, G, room=10**6)
    assert decoder.completion_kv[0][0].shape[2] == GroupKV.FIRST_ROOM
    monkeypatch.setattr(GroupKV, "FIRST_ROOM", 3)  # grows 3 -> 6 -> 11 columns within 11 tokens
    params = SamplingParams(max_tokens=11, temperature=1.0, seed=0)
    slow, fast = (sample(model, PROMPTS, G, params, pad_token_id=0, eos_token_id=[], fast_decode=f) for f in (0, 1))
    assert all(len(c.tokens) == 11 for c in fast)
    for a, b in zip(slow, fast, strict=True):
        assert a.tokens == b.tokens and a.logprobs == pytest.approx(b.logprobs, abs=1e-10)
