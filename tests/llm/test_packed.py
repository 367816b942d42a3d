"""edurl.llm.packed: a batch's prompts and completions scored in one pass, without the completions' padding, equal
the model's own forward (the prompts, then the padded completions against their KV cache) in log-probs, entropy
and every parameter's gradient, in float64."""

import copy

import pytest
import torch

from edurl.llm import shared_prefix
from edurl.llm.packed import packed_logits
from edurl.llm.padding import pad
from edurl.llm.shared_prefix import token_logprobs

from .conftest import random_llama_family


def _batch(prompts, tails, order="grouped"):
    rows = [p + t for p, t in zip(prompts, tails)]
    masks = [[0] * (len(p) - 1) + [1] * len(t) for p, t in zip(prompts, tails)]
    if order == "interleaved":
        rows, masks = rows[0::2] + rows[1::2], masks[0::2] + masks[1::2]
    ids, attn = pad(rows, 0)
    targets = torch.roll(ids, -1, dims=1) * attn
    mask = pad(masks, 0, dtype=torch.float32, length=ids.shape[1])[0]
    return ids, attn, targets, mask


def _scored(model, ids, attn, targets, mask, packed: bool, temperature=1.0, prompt_grad=True, weights=None):
    """Log-probs, entropy and the gradient of a weighted sum of the log-probs (over ``mask``'s positions, or
    ``weights``), with or without packing."""
    model.zero_grad()
    lp, ent = token_logprobs(
        model,
        ids,
        attn,
        targets,
        mask,
        model_config=model.config,
        with_entropy=True,
        temperature=temperature,
        model=model if packed else None,
        prompt_grad=prompt_grad,
    )
    if weights is None:
        weights = mask * torch.arange(1.0, 1.0 + ids.shape[1], dtype=lp.dtype)  # each position counts differently
    (lp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return lp.detach(), ent, grads


def _groups(G=3):
    """Two prompts of different lengths (so the shorter one is left-padded), G completions of different lengths."""
    prompt_a, prompt_b = [3, 35, 33, 19, 32, 4], [3, 9, 12]
    tails_a = [[5, 6], [7], [8, 9, 10, 11, 13]][:G]
    tails_b = [[14, 15, 16], [17, 18, 19, 20], [21]][:G]
    return [prompt_a] * G + [prompt_b] * G, tails_a + tails_b


def _assert_same(a, b):
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = a, b
    assert torch.allclose(lp_a, lp_b, atol=1e-10, rtol=0)
    assert torch.allclose(ent_a, ent_b, atol=1e-10, rtol=0)
    assert g_a.keys() == g_b.keys() and len(g_a) > 0
    for name in g_a:
        assert torch.allclose(g_a[name], g_b[name], atol=1e-10, rtol=1e-9), name


@pytest.mark.parametrize("order", ["grouped", "interleaved"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_completions_equal_the_padded_pass(small_model, order, temperature):
    model = copy.deepcopy(small_model).double()
    ids, attn, targets, mask = _batch(*_groups(), order=order)
    packed = _scored(model, ids, attn, targets, mask, True, temperature)
    padded = _scored(model, ids, attn, targets, mask, False, temperature)
    _assert_same(packed, padded)


def test_the_packed_pass_runs_only_the_real_tokens(small_model, monkeypatch):
    """The packed pass is taken (not a silent fallback) and the model's forward is not called; its rows are each
    distinct prompt once and the completions' real tokens."""
    seen = []
    original = shared_prefix.packed_logits

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append((tuple(out[0].shape[:2]), out[1].shape[0]))
        return out

    monkeypatch.setattr(shared_prefix, "packed_logits", spy)
    prompts, tails = _groups()
    ids, attn, targets, mask = _batch(prompts, tails)

    def no_forward(**inputs):
        raise AssertionError("the packed pass calls the layers' modules, not the model's forward")

    token_logprobs(no_forward, ids, attn, targets, mask, model_config=small_model.config, model=small_model)
    # two prompts (6 and 3 tokens, left-padded to 6), then every row's tokens after its prompt, and not the padding
    # up to the longest (5 tokens x 6 rows)
    assert seen == [((2, 6), sum(len(t) for t in tails))] and seen[0][1] < 5 * len(tails)


@pytest.mark.parametrize("order", ["grouped", "interleaved"])
def test_a_prompt_that_needs_no_gradient_skips_the_top_layers_backward_over_it(small_model, order):
    """``prompt_grad=False`` (the loss reads no prompt position): the top layer's MLP runs its backward pass on
    each prompt's last position and the completions only, and every log-prob (the prompt's too), entropy and
    gradient stays the model's forward's."""
    model = copy.deepcopy(small_model).double()
    ids, attn, targets, mask = _batch(*_groups(), order=order)
    rows = []
    hook = model.model.layers[-1].mlp.register_full_backward_hook(lambda m, gi, go: rows.append(go[0].shape[0]))
    promised = _scored(model, ids, attn, targets, mask, True, prompt_grad=False)
    assert rows == [2 + int(mask.sum())]  # 2 prompts' last positions, then each row's tokens after its prompt
    rows.clear()
    kept = _scored(model, ids, attn, targets, mask, True)
    assert rows == [2 * 6 + int(mask.sum())]  # every prompt position (2 prompts, left-padded to 6)
    hook.remove()
    _assert_same(promised, _scored(model, ids, attn, targets, mask, False))
    _assert_same(kept, promised)


def test_a_prompt_that_needs_its_gradient_keeps_it(small_model):
    """With ``prompt_grad=True`` (the default) a loss may read the prompt's positions: their gradient is kept."""
    model = copy.deepcopy(small_model).double()
    ids, attn, targets, mask = _batch(*_groups())
    everywhere = attn.double()  # a loss over every position, the prompt's included
    packed = _scored(model, ids, attn, targets, mask, True, weights=everywhere)
    _assert_same(packed, _scored(model, ids, attn, targets, mask, False, weights=everywhere))


def test_without_packing_a_prompt_that_needs_no_gradient_changes_nothing(small_model):
    """``prompt_grad=False`` on the model's forward (no packed pass) keeps every gradient."""
    model = copy.deepcopy(small_model).double()
    ids, attn, targets, mask = _batch(*_groups())
    promised = _scored(model, ids, attn, targets, mask, False, prompt_grad=False)
    _assert_same(promised, _scored(model, ids, attn, targets, mask, False))


def test_grouped_query_attention_and_biases_match():
    """A Qwen2 model with grouped-query attention (2 key/value heads for 4 query heads) and q/k/v biases."""
    model = random_llama_family("qwen2", torch.float64)  # its q/k/v biases drawn so that they count
    ids, attn, targets, mask = _batch(*_groups())
    _assert_same(_scored(model, ids, attn, targets, mask, True), _scored(model, ids, attn, targets, mask, False))


def test_lora_adapters_are_applied_and_trained(small_model):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        copy.deepcopy(small_model).double(),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # B starts at 0: give the adapters an effect
    ids, attn, targets, mask = _batch(*_groups())
    packed = _scored(model, ids, attn, targets, mask, True)
    _assert_same(packed, _scored(model, ids, attn, targets, mask, False))
    assert all("lora_" in n for n in packed[2])  # only the adapters train


def test_an_unsupported_model_gets_none():
    model = torch.nn.Linear(2, 2)
    u = torch.zeros(1, dtype=torch.long)
    ids = torch.ones(1, 2, dtype=torch.long)
    assert packed_logits(model, ids, torch.ones(1, 2), u, ids, ids.bool()) is None


def test_rows_out_of_group_order_give_the_same_gradient_every_time(small_model):
    """Rows not in GRPO's group order (e.g. two problems of a batch that are the same, whose prompt then has 2G rows) give
    each row its prompt's keys by index_select, whose backward pass sums into the prompts in a fixed order. An
    advanced index (``keys[u]``) there summed in an order that changed from call to call on 2 threads: a 150-step
    GRPO run stopped repeating itself at step 138."""
    from edurl.utils import torch_threads

    prompts = [[3, 35, 33, 19, 32, 4], [3, 9, 12], [3, 7, 7, 8]]
    tails = [[5 + (i % 7), 6, 7 + (i % 3), 8][: 1 + i % 4] for i in range(240)]
    ids, attn, targets, mask = _batch([prompts[i % 3] for i in range(240)], tails)  # interleaved: 0, 1, 2, 0, ...
    with torch_threads(2):
        grads = [torch.cat([g.flatten() for g in _scored(small_model, ids, attn, targets, mask, True)[2].values()])]
        for _ in range(5):
            again = _scored(small_model, ids, attn, targets, mask, True)[2]
            grads.append(torch.cat([g.flatten() for g in again.values()]))
    assert all(torch.equal(grads[0], g) for g in grads[1:])


def test_a_model_training_with_attention_dropout_keeps_its_forward(small_model):
    """The packed pass has no attention dropout, so a model that would drop attention weights gets None (the
    caller falls back to the model's forward); the training client switches dropout off, so it packs."""
    model = copy.deepcopy(small_model).train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    prompts, tails = _groups()
    ids, attn, targets, mask = _batch(prompts, tails)
    args = (ids[[0, 3], :6], torch.ones(2, 6), torch.tensor([0, 0, 0, 1, 1, 1]), ids[:, 6:9], torch.ones(6, 3))
    assert packed_logits(model, *args) is None
    model.eval()
    assert packed_logits(model, *args) is not None
