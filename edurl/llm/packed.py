"""Training's completion pass without padding: every completion token of a batch in one row of tokens.

:func:`edurl.llm.shared_prefix.token_logprobs` runs each distinct prompt once, then every datum's completion
against its prompt's keys and values. Through the model's own forward, the completions are right-padded to the
longest one, and each layer's projections and MLP run on the padding too: in GRPO steps of 32 x 8 on the course's
model, a median 11 % of the completion rows were padding (benchmarks/README.md, "The sixth cut"), and the KV cache
copied each prompt's keys and values once per completion. Here, for the Llama-family models that
:func:`edurl.llm.decode.layer_by_layer_lm` accepts, the layers run from their own modules (LoRA adapters included)
on the N real completion tokens only::

    h = embed(tokens)                                   (N, hidden): the batch's completion tokens, end to end
    for each layer:
        q, k, v = projections(norm(h)), rotated at each token's position          (N, heads, head_dim)
        spread q, k, v into rows, (U prompts, heads, G rows each, Lr, head_dim), for the attention alone
        scores = [q . prompt keys of the row's prompt | q . the row's own keys, causal]
                 (a group's G rows meet their prompt's keys in one matrix product, without G copies of them)
        a = softmax(scores) @ [prompt values | the row's own values], gathered back to (N, heads * head_dim)
        h = h + o_proj(a);  h = h + mlp(norm(h))
    logits = lm_head(norm(h))                           (N, vocab)

It is the model's arithmetic in another order, so the log-probs and gradients equal those of the padded pass up to
rounding (tests/llm/test_packed.py checks them in float64). The attention itself still runs on the padded layout,
where its scores are a small matrix per row; the projections and MLP, which hold most of the work, do not.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from edurl.llm.decode import layer_by_layer_lm

__all__ = ["packed_continuations"]


def packed_continuations(
    model: nn.Module,
    prompt_kv: list[tuple[torch.Tensor, torch.Tensor]],
    prompt_mask: torch.Tensor,
    prompt_end: torch.Tensor,
    u: torch.Tensor,
    rest_ids: torch.Tensor,
    rest_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Run each row's continuation against its prompt's keys and values, on the real tokens only.

    ``prompt_kv`` holds each layer's (keys, values) of the U distinct prompts, (U, kv_heads, Lp, head_dim), left-
    padded with ``prompt_mask`` (U, Lp); ``prompt_end`` (U,) is the position id of each prompt's last token.
    Row b (of B) continues prompt ``u[b]`` with ``rest_ids[b]`` (B, Lr), right-padded with ``rest_mask``.
    Returns ``(logits, where)``: the next-token logits of the N real continuation tokens, (N, vocab), in row-major
    order, and their flat indices into (B, Lr). None when ``model`` is not one that runs layer by layer here, or
    when it is training with attention dropout (the caller then uses the model's forward)."""
    lm = layer_by_layer_lm(model)
    if lm is None:
        return None
    layers = list(lm.model.layers)
    if any(layer.self_attn.training and getattr(layer.self_attn, "attention_dropout", 0.0) for layer in layers):
        return None  # the model's forward drops attention weights at random in training; this pass does not
    if len(prompt_kv) != len(layers):
        raise ValueError(f"prompt_kv has {len(prompt_kv)} layers; the model has {len(layers)}")
    B, Lr = rest_ids.shape
    U, Lp = prompt_mask.shape
    dev = rest_ids.device
    where = rest_mask.flatten().nonzero().squeeze(1)  # (N,) flat indices of the real tokens
    j = torch.arange(Lr, device=dev)
    positions = (prompt_end[u][:, None] + 1 + j).flatten()[where]  # (N,)
    h = lm.model.embed_tokens(rest_ids.flatten()[where])[None]  # (1, N, hidden)
    cos, sin = lm.model.rotary_emb(h, positions[None])
    cos, sin = cos[0, :, None], sin[0, :, None]  # (N, 1, head_dim): broadcast over heads
    dtype = h.dtype
    soft_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    G = B // U
    if not (G * U == B and torch.equal(u, torch.arange(U, device=dev).repeat_interleave(G))):
        # rows not in groups of G per prompt (GRPO's order): give each row its own copy of its prompt
        prompt_kv = [(k.index_select(0, u), v.index_select(0, u)) for k, v in prompt_kv]
        prompt_mask, U, G = prompt_mask[u], B, 1
    # each token's place in the attention's layout (U, heads, G, Lr, head_dim), per head: a row of its
    # (U * heads * G * Lr, head_dim) flattening; token n's head h at place[n, h]
    row, col = where // Lr, where % Lr
    heads = torch.arange(lm.config.num_attention_heads, device=dev)
    place = ((((row // G)[:, None] * len(heads) + heads) * G + (row % G)[:, None]) * Lr + col[:, None]).flatten()
    # the additive mask over [prompt columns | the row's own columns]: padding and the future get no attention
    prompt_bias = torch.zeros(U, Lp, dtype=dtype, device=dev).masked_fill_(~prompt_mask.bool(), float("-inf"))
    own_bias = torch.full((Lr, Lr), float("-inf"), dtype=dtype, device=dev).triu_(1)
    bias = torch.cat([prompt_bias[:, None, None, None].expand(U, 1, 1, Lr, Lp), own_bias.expand(U, 1, 1, Lr, Lr)], -1)
    h = h[0]  # (N, hidden)
    N = len(where)
    for layer, (pk, pv) in zip(layers, prompt_kv):
        attn = layer.self_attn
        D = attn.head_dim
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(N, -1, D)  # (N, heads, head_dim)
        k = attn.k_proj(x).view(N, -1, D)  # (N, kv_heads, head_dim)
        v = attn.v_proj(x).view(N, -1, D)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        H = q.shape[1]
        if k.shape[1] != H:  # grouped-query attention: each key/value head serves H / kv_heads query heads
            n = H // k.shape[1]
            k, v, pk, pv = (
                k.repeat_interleave(n, 1),
                v.repeat_interleave(n, 1),
                pk.repeat_interleave(n, 1),
                pv.repeat_interleave(n, 1),
            )
        q, k, v = (_spread(t, place, U, G, Lr) for t in (q, k, v))  # (U, heads, G, Lr, head_dim)
        # a group's G rows meet their prompt's keys in one product: (U, heads, G * Lr, head_dim) @ (U, heads, ., Lp)
        prompt_scores = (q.view(U, H, G * Lr, D) @ pk.transpose(-1, -2)).view(U, H, G, Lr, Lp)
        scores = torch.cat([prompt_scores, q @ k.transpose(-1, -2)], -1) * attn.scaling + bias
        p = torch.softmax(scores, -1, dtype=soft_dtype).to(dtype)  # (U, heads, G, Lr, Lp + Lr)
        a = (p[..., :Lp].reshape(U, H, G * Lr, Lp) @ pv).view(U, H, G, Lr, D) + p[..., Lp:] @ v
        a = a.view(-1, D).index_select(0, place).view(N, H * D)  # back to the tokens: (N, heads * head_dim)
        h = h + attn.o_proj(a)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return lm.lm_head(lm.model.norm(h)), where


def _spread(t: torch.Tensor, place: torch.Tensor, U: int, G: int, Lr: int) -> torch.Tensor:
    """(N, heads, head_dim) tokens -> (U, heads, G, Lr, head_dim), zeros at the padding, each token's head h at
    row ``place[n * heads + h]`` of the flattening (differentiably: the gradient is gathered back)."""
    N, H, D = t.shape
    return t.new_zeros(U * H * G * Lr, D).index_copy(0, place, t.reshape(N * H, D)).view(U, H, G, Lr, D)
