import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama import modeling_llama

from edurl.llm.padding import pad
from edurl.llm.shared_prefix import (
    _ATTENTION_READ_AT_EACH_CALL,
    EAGER_ATTENTION_MAX_TOKENS,
    _give_rows_their_prompts,
    scaled_log_softmax,
    short_row_attention,
    token_logprobs,
)


def batch(rows, masks):
    ids, attn = pad(rows, 0)
    targets = torch.roll(ids, -1, dims=1) * attn  # any fixed targets: the test compares two ways to score them
    mask = pad(masks, 0, dtype=torch.float32, length=ids.shape[1])[0]
    return ids, attn, targets, mask


def scored(model, ids, attn, targets, mask, weights=None, **kw):
    """token_logprobs' log-probs and entropy, and the gradient of sum(log-probs * weights) (``mask`` by default)."""
    model.zero_grad()
    lp, ent = token_logprobs(model, ids, attn, targets, mask, model_config=model.config, **kw)
    (lp * (mask if weights is None else weights)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return lp.detach(), ent, grads


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_shared_prompt_scores_what_whole_rows_score(small_model, temperature):
    prompt_a, prompt_b = [3, 35, 33, 19, 32, 100], [3, 35, 9]
    rows = [prompt_a + [7, 8, 9], prompt_b + [4], prompt_a + [10, 11], prompt_b + [12, 13, 14, 15]]
    masks = [
        [0] * (len(prompt_a) - 1) + [1] * 4,
        [0] * (len(prompt_b) - 1) + [1] * 2,
        [0] * (len(prompt_a) - 1) + [1] * 3,
        [0] * (len(prompt_b) - 1) + [1] * 5,
    ]
    ids, attn, targets, mask = batch(rows, masks)
    kw = dict(temperature=temperature, with_entropy=True, model_config=small_model.config)
    shared = token_logprobs(small_model, ids, attn, targets, mask, share_prompts=True, **kw)
    whole = token_logprobs(small_model, ids, attn, targets, mask, share_prompts=False, **kw)
    keep = attn.bool()
    for a, b in zip(shared, whole):
        assert torch.allclose(a[keep], b[keep], atol=1e-5)
        assert (a[~keep] == 0).all()


def test_the_gradient_through_the_shared_prompt_matches_whole_rows(small_model):
    rows = [[3, 35, 33, 19, 5, 6], [3, 35, 33, 19, 7], [3, 35, 33, 19, 8, 9, 10]]
    masks = [[0, 0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1, 1, 1]]
    ids, attn, targets, mask = batch(rows, masks)
    grads = [scored(small_model, ids, attn, targets, mask, share_prompts=share)[2] for share in (True, False)]
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-5), name


@pytest.mark.parametrize("order", ["grouped", "interleaved"])
def test_grouped_and_interleaved_rows_get_their_prompts_gradients(small_model, monkeypatch, order):
    """GRPO's rows come as G rows of prompt 0, then G of prompt 1: their prompts' keys and values are repeated by
    expand (its backward sums the group's gradients); any other order goes through reorder_cache's index_select.
    Both must give whole rows' log-probs and gradients, prompts of different lengths included."""
    prompt_a, prompt_b = [3, 35, 33, 19, 32], [3, 9]
    tails = [[5, 6], [7], [8, 9, 10]]
    rows = [prompt_a + t for t in tails] + [prompt_b + t[::-1] for t in tails]
    masks = [[0] * (len(r) - len(t) - 1) + [1] * len(t) for r, t in zip(rows, tails + [t[::-1] for t in tails])]
    if order == "interleaved":
        rows, masks = rows[0::2] + rows[1::2], masks[0::2] + masks[1::2]
    reorders = []
    original = DynamicCache.reorder_cache
    monkeypatch.setattr(DynamicCache, "reorder_cache", lambda self, u: reorders.append(u) or original(self, u))
    ids, attn, targets, mask = batch(rows, masks)
    weights = mask * torch.arange(1.0, 1.0 + ids.shape[1])  # each position counts differently
    (lp_shared, _, g_shared), (lp_whole, _, g_whole) = (
        scored(small_model, ids, attn, targets, mask, weights, share_prompts=share) for share in (True, False)
    )
    assert len(reorders) == (0 if order == "grouped" else 1)
    assert torch.allclose(lp_shared * attn, lp_whole * attn, atol=1e-5)
    for name in g_whole:
        assert torch.allclose(g_shared[name], g_whole[name], atol=1e-5), name


def test_distinct_prompts_fall_back_to_whole_rows(small_model):
    calls = []

    def forward(**inputs):
        calls.append(inputs["input_ids"].shape)
        return small_model(**inputs)

    ids, attn, targets, mask = batch([[3, 4, 5, 6], [7, 8, 9]], [[0, 1, 1], [0, 1]])
    token_logprobs(forward, ids, attn, targets, mask, model_config=small_model.config)
    assert calls == [ids.shape]  # one pass over whole rows: two prompts for two rows would not pay


def test_scaled_log_softmax_treats_temperature_zero_as_one():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    assert torch.allclose(scaled_log_softmax(logits, 0), torch.log_softmax(logits, -1))
    assert torch.allclose(scaled_log_softmax(logits, 0.5), torch.log_softmax(logits / 0.5, -1))


@pytest.mark.skipif(not _ATTENTION_READ_AT_EACH_CALL, reason="this transformers cannot switch attention per call")
def test_short_rows_attend_eagerly_on_the_cpu_and_long_rows_keep_sdpa(small_model, monkeypatch):
    seen, eager_calls = [], []

    def forward(**inputs):
        seen.append(small_model.config._attn_implementation)
        return small_model(**inputs)

    eager = modeling_llama.eager_attention_forward  # the kernel itself ran, not only the setting changed
    monkeypatch.setattr(
        modeling_llama, "eager_attention_forward", lambda *a, **k: eager_calls.append(1) or eager(*a, **k)
    )
    config = small_model.config
    assert config._attn_implementation == "sdpa"
    for length, want in ((EAGER_ATTENTION_MAX_TOKENS, "eager"), (EAGER_ATTENTION_MAX_TOKENS + 1, "sdpa")):
        seen.clear(), eager_calls.clear()
        rows = [[3, 35, 5] + [6] * (length - 3), [3, 35, 7]]
        ids, attn, targets, mask = batch(rows, [[0, 1] + [1] * (length - 3), [0, 1]])
        token_logprobs(forward, ids, attn, targets, mask, model_config=config, eager_short_rows=True)
        assert len(seen) == 2 and set(seen) == {want}, (length, seen)  # the prompt's pass and the completions'
        assert len(eager_calls) == (2 * config.num_hidden_layers if want == "eager" else 0)
        assert config._attn_implementation == "sdpa"  # put back
    seen.clear()  # distinct prompts are scored whole, with the model's own attention (e.g. SFT batches)
    ids, attn, targets, mask = batch([[3, 4, 5, 6], [7, 8, 9]], [[0, 1, 1], [0, 1]])
    token_logprobs(forward, ids, attn, targets, mask, model_config=config, eager_short_rows=True)
    assert seen == ["sdpa"]
    with short_row_attention(config, 8, torch.device("cuda")):  # a GPU keeps its fused kernels
        assert config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), short_row_attention(config, 8, torch.device("cpu")):
        assert config._attn_implementation == "eager"
        raise RuntimeError("a failing forward")
    assert config._attn_implementation == "sdpa"


def test_eager_and_sdpa_give_the_same_log_probs_and_gradients(small_model):
    """The switch changes the kernels, not the arithmetic: left-padded prompts of different lengths, grouped rows."""
    prompt_a, prompt_b = [3, 35, 33, 19, 32, 100], [3, 9]
    tails = [[5, 6, 4], [7], [8, 9]]
    rows = [prompt_a + t for t in tails] + [prompt_b + t for t in tails]
    masks = [[0] * (len(r) - len(t) - 1) + [1] * len(t) for r, t in zip(rows, tails + tails)]
    ids, attn, targets, mask = batch(rows, masks)
    results = [
        scored(small_model, ids, attn, targets, mask, with_entropy=True, eager_short_rows=eager)
        for eager in (True, False)
    ]
    (lp_e, ent_e, g_e), (lp_s, ent_s, g_s) = results
    assert torch.allclose(lp_e, lp_s, atol=1e-5) and torch.allclose(ent_e, ent_s, atol=1e-5)
    for name in g_s:
        assert torch.allclose(g_e[name], g_s[name], atol=1e-5), name


@pytest.mark.parametrize(
    "u",
    [[0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 1, 2, 0, 1, 2], [0, 0, 1, 1], [2, 2, 0, 0, 1, 1], [1, 0, 2]],
    ids=["grouped", "interleaved", "a subset of the prompts", "groups out of order", "one row each, permuted"],
)
def test_rows_get_their_prompts_keys_and_values_in_any_layout(u):
    """_give_rows_their_prompts against reorder_cache's index_select, for a cache of 3 prompts and 2 layers."""
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(3, 2, 4, 5, generator=g), torch.randn(3, 2, 4, 5, generator=g)) for _ in range(2)]
    caches = []
    for _ in range(2):
        cache = DynamicCache()
        for i, (k, v) in enumerate(kv):
            cache.update(k.clone(), v.clone(), i)
        caches.append(cache)
    index = torch.tensor(u)
    _give_rows_their_prompts(caches[0], index)
    caches[1].reorder_cache(index)
    for i in range(2):
        for got, want in zip(_layer_kv(caches[0], i), _layer_kv(caches[1], i)):
            assert torch.equal(got, want)


def _layer_kv(cache, i):
    layers = getattr(cache, "layers", None)
    return (layers[i].keys, layers[i].values) if layers is not None else (cache.key_cache[i], cache.value_cache[i])


def _reference(logits, rows, tokens, temperature):
    """The whole float32-or-wider log-softmax, indexed: what the lean path must equal."""
    logp = scaled_log_softmax(logits, temperature)
    return logp[rows, tokens], -(logp.exp() * logp).sum(-1)[rows]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_the_lean_scores_equal_the_whole_log_softmax_with_their_gradients(monkeypatch, temperature):
    """Past LEAN_VOCAB, Scores keeps only the logits and each row's logsumexp and rebuilds the softmax in chunks
    in the backward pass; rows read by several pairs (a shared prompt's positions) sum their gradients."""
    from edurl.llm import shared_prefix

    monkeypatch.setattr(shared_prefix, "LEAN_VOCAB", 0)
    monkeypatch.setattr(shared_prefix, "LEAN_CHUNK_BYTES", 4 * 50 * 3)  # chunks of 3 rows: the seams are crossed
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(10, 50, generator=g, dtype=torch.float64)).requires_grad_()
    rows = torch.tensor([[0, 0, 3, 9], [3, 5, 5, 5]])
    tokens = torch.tensor([[1, 1, 7, 49], [2, 0, 0, 8]])
    weights = torch.randn(rows.shape, generator=g, dtype=torch.float64)
    scores = shared_prefix.Scores(logits, temperature, with_entropy=True)
    assert scores.lean
    lp, ent = scores.at(rows, tokens), scores.entropy(rows)
    (grad,) = torch.autograd.grad((lp * weights).sum(), logits)
    want_lp, want_ent = _reference(logits, rows, tokens, temperature)
    (want_grad,) = torch.autograd.grad((want_lp * weights).sum(), logits)
    assert torch.allclose(lp, want_lp, rtol=1e-12, atol=1e-12)
    assert torch.allclose(ent, want_ent, rtol=1e-12, atol=1e-12)
    assert torch.allclose(grad, want_grad, rtol=1e-12, atol=1e-12)


def test_lean_scores_of_bf16_logits_keep_a_fraction_of_the_memory(monkeypatch):
    """For 16-bit logits the whole log-softmax saved a float32 copy of them for the backward pass (twice their
    bytes) and the entropy made three more: the lean path saves the logits themselves and one float per row."""
    from edurl.llm import shared_prefix

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 5000, generator=g).to(torch.bfloat16).requires_grad_()
    rows, tokens = torch.arange(64), torch.randint(0, 5000, (64,), generator=g)

    def saved_bytes(make):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = make()
        return out, sum(seen.values())

    monkeypatch.setattr(shared_prefix, "LEAN_VOCAB", 10**9)
    whole, whole_bytes = saved_bytes(lambda: shared_prefix.Scores(logits, 1.0, True).at(rows, tokens))
    monkeypatch.setattr(shared_prefix, "LEAN_VOCAB", 0)
    lean, lean_bytes = saved_bytes(lambda: shared_prefix.Scores(logits, 1.0, True).at(rows, tokens))
    assert lean_bytes < 1.1 * logits.numel() * 2 and whole_bytes > 2 * logits.numel() * 2 - 1
    assert torch.allclose(lean, whole, atol=1e-6)
    (g_lean,) = torch.autograd.grad(lean.sum(), logits)
    (g_whole,) = torch.autograd.grad(whole.sum(), logits)
    assert g_lean.dtype == torch.bfloat16
    assert torch.allclose(g_lean.float(), g_whole.float(), atol=1e-3)


@pytest.mark.parametrize("share", [True, False])
def test_training_log_probs_take_the_lean_path_for_a_large_vocabulary(small_model, monkeypatch, share):
    """Every way token_logprobs scores (shared prompts, packed or not, and whole rows) through the lean path."""
    from edurl.llm import shared_prefix

    rows = [[3, 35, 33, 19, 5, 6], [3, 35, 33, 19, 7], [3, 35, 33, 19, 8, 9, 10], [3, 35, 33, 19, 11]]
    masks = [[0, 0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1, 1, 1], [0, 0, 0, 1]]
    ids, attn, targets, mask = batch(rows, masks)
    kw = dict(share_prompts=share, with_entropy=True, temperature=0.7)
    want = scored(small_model, ids, attn, targets, mask, **kw)
    monkeypatch.setattr(shared_prefix, "LEAN_VOCAB", 0)
    calls, lean = [], shared_prefix._PickedLogprobs.apply
    monkeypatch.setattr(shared_prefix._PickedLogprobs, "apply", lambda *args: calls.append(1) or lean(*args))
    for packed in (True, False):  # with model=, the CPU's packed pass; without, the prompt cache
        small_model.zero_grad()
        calls.clear()
        lp, ent = token_logprobs(
            small_model,
            ids,
            attn,
            targets,
            mask,
            model_config=small_model.config,
            model=small_model if packed else None,
            **kw,
        )
        (lp * mask).sum().backward()
        got = (lp.detach(), ent, {n: p.grad.clone() for n, p in small_model.named_parameters() if p.grad is not None})
        assert calls  # the lean path scored them
        small_model.zero_grad()
        assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)
        assert got[2].keys() == want[2].keys()
        for name in want[2]:
            assert torch.allclose(got[2][name], want[2][name], atol=1e-5), name


@pytest.mark.parametrize("lean", [False, True])
def test_a_target_outside_the_vocabulary_is_refused_not_read_elsewhere(monkeypatch, lean):
    """Flat indexing read another position's log-prob for a target of -100 or V, where gather had raised."""
    from edurl.llm import shared_prefix

    monkeypatch.setattr(shared_prefix, "LEAN_VOCAB", 0 if lean else 4096)
    scores = shared_prefix.Scores(torch.randn(4, 10), 1.0, with_entropy=False)
    for bad in (-100, 10):
        with pytest.raises(ValueError, match=r"target tokens must be ids in \[0, 10\)"):
            scores.at(torch.tensor([0, 1]), torch.tensor([3, bad]))
    assert scores.at(torch.tensor([0, 1]), torch.tensor([3, 9])).shape == (2,)
