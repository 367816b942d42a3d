"""Training's pass without padding: a batch's prompts and completions in one row of tokens per layer.

:func:`edurl.llm.shared_prefix.token_logprobs` runs each distinct prompt once, then every datum's completion
against its prompt's keys and values. Through the model's own forward that takes two passes, the prompts' and the
completions', and the completions are right-padded to the longest one, so each layer's projections and MLP run on
the padding too: in GRPO steps of 32 x 8 on the course's model, a median 11 % of the completion rows were padding
(benchmarks/README.md, "The sixth cut"), and the KV cache copied each prompt's keys and values once per completion.
Here, for the Llama-family models that :func:`edurl.llm.decode.layer_by_layer_lm` accepts, the layers run from
their own modules (LoRA adapters included), once, on the M = U * Lp prompt positions and the N real completion
tokens together::

    h = embed([prompt tokens | completion tokens])      (M + N, hidden): the batch's tokens, end to end
    for each layer:
        q, k, v = projections(norm(h)), rotated at each token's position          (M + N, heads, head_dim)
        the prompts: causal attention within each prompt, (U, heads, Lp, Lp); left padding gets none
        the completions: q, k, v spread into rows, (U prompts, heads, G rows each, Lr, head_dim), for the
            attention alone
            scores = [q . prompt keys of the row's prompt | q . the row's own keys, causal]
                     (a group's G rows meet their prompt's keys in one matrix product, without G copies of them)
            a = softmax(scores) @ [prompt values | the row's own values], gathered back to (N, heads * head_dim)
        h = h + o_proj([a of the prompts | a of the completions]);  h = h + mlp(norm(h))
    logits = lm_head(norm(h))                           (U, Lp, vocab) and (N, vocab)

It is the model's arithmetic in another order, so the log-probs and gradients equal those of the model's forward
up to rounding (tests/llm/test_packed.py checks them in float64). The attention itself runs on padded layouts,
where its scores are a small matrix per row; the projections and MLP, which hold most of the work, run once per
layer on real tokens (and the prompts' few left-padding positions).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from edurl.llm.decode import layer_by_layer_lm

__all__ = ["packed_lm", "packed_logits"]


def packed_lm(model: nn.Module) -> nn.Module | None:
    """The causal LM inside ``model`` that :func:`packed_logits` runs layer by layer, or None: a model that
    :func:`edurl.llm.decode.layer_by_layer_lm` does not accept, or one training with attention dropout (the model's
    forward drops attention weights at random in training; this pass does not)."""
    lm = layer_by_layer_lm(model)
    if lm is None:
        return None
    if any(
        layer.self_attn.training and getattr(layer.self_attn, "attention_dropout", 0.0) for layer in lm.model.layers
    ):
        return None
    return lm


def packed_logits(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    u: torch.Tensor,
    rest_ids: torch.Tensor,
    rest_mask: torch.Tensor,
    prompt_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The U distinct prompts, and each row's continuation of its prompt, in one pass on their real tokens.

    ``prompt_ids`` (U, Lp) are left-padded, with ``prompt_mask`` (1 on real tokens); their position ids count the
    real tokens from 0, as the model's forward gives them. Row b (of B) continues prompt ``u[b]`` with
    ``rest_ids[b]`` (B, Lr), right-padded with ``rest_mask``. Returns ``(prompt_logits, logits, where)``: the
    prompts' next-token logits (U, Lp, vocab), the N real continuation tokens' (N, vocab) in row-major order, and
    their flat indices into (B, Lr). None when :func:`packed_lm` does not run ``model`` (the caller then uses the
    model's forward).

    ``prompt_grad=False``: the caller needs no gradient through the prompts' logits but their last column's (the
    first completion token's), as when a loss reads no prompt position. The other prompt logits then come without a
    graph, and the top layer's output projection, MLP and LM head run their backward on the last column and the
    continuations alone: the prompt positions feed the completions only through their keys and values below."""
    lm = packed_lm(model)
    if lm is None:
        return None
    B, Lr = rest_ids.shape
    U, Lp = prompt_mask.shape
    M = U * Lp
    dev = rest_ids.device
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (U, Lp)
    where = rest_mask.flatten().nonzero().squeeze(1)  # (N,) flat indices of the real continuation tokens
    N = len(where)
    j = torch.arange(Lr, device=dev)
    positions = torch.cat([prompt_pos.flatten(), (prompt_pos[u, -1:] + 1 + j).flatten()[where]])  # (M + N,)
    h = lm.model.embed_tokens(torch.cat([prompt_ids.flatten(), rest_ids.flatten()[where]]))[None]
    cos, sin = lm.model.rotary_emb(h, positions[None])
    cos, sin = cos[0, :, None], sin[0, :, None]  # (M + N, 1, head_dim): broadcast over heads
    dtype = h.dtype
    soft_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    G = B // U
    grouped = G * U == B and torch.equal(u, torch.arange(U, device=dev).repeat_interleave(G))
    # rows not in groups of G per prompt (GRPO's order) get their own copy of their prompt's keys
    Ur, Gr = (U, G) if grouped else (B, 1)
    # each continuation token's place in the attention's layout (Ur, heads, Gr, Lr, head_dim), per head: a row of
    # its (Ur * heads * Gr * Lr, head_dim) flattening; token n's head h at place[n, h]
    row, col = where // Lr, where % Lr
    heads = torch.arange(lm.config.num_attention_heads, device=dev)
    place = ((((row // Gr)[:, None] * len(heads) + heads) * Gr + (row % Gr)[:, None]) * Lr + col[:, None]).flatten()
    # additive masks: a prompt position sees the real positions up to it (a padding position only itself, so that
    # its softmax stays finite; nothing reads its output); a continuation token sees its prompt's real positions
    # and its own row up to it
    real = prompt_mask.bool()
    sees = torch.ones(Lp, Lp, dtype=torch.bool, device=dev).tril_() & real[:, None, :]
    sees |= torch.eye(Lp, dtype=torch.bool, device=dev)
    prompt_bias = torch.zeros(U, 1, Lp, Lp, dtype=dtype, device=dev).masked_fill_(~sees[:, None], float("-inf"))
    real_keys = real if grouped else real[u]
    keys_bias = torch.zeros(Ur, Lp, dtype=dtype, device=dev).masked_fill_(~real_keys, float("-inf"))
    own_bias = torch.full((Lr, Lr), float("-inf"), dtype=dtype, device=dev).triu_(1)
    rest_bias = torch.cat(
        [keys_bias[:, None, None, None].expand(Ur, 1, 1, Lr, Lp), own_bias.expand(Ur, 1, 1, Lr, Lr)], -1
    )
    h = h[0]  # (M + N, hidden)
    top = len(lm.model.layers) - 1
    for i, layer in enumerate(lm.model.layers):
        attn = layer.self_attn
        D = attn.head_dim
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(M + N, -1, D)  # (M + N, heads, head_dim)
        k = attn.k_proj(x).view(M + N, -1, D)  # (M + N, kv_heads, head_dim)
        v = attn.v_proj(x).view(M + N, -1, D)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        H = q.shape[1]
        if k.shape[1] != H:  # grouped-query attention: each key/value head serves H / kv_heads query heads
            n = H // k.shape[1]
            k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
        # the prompts, each within itself
        qp, kp, vp = (t[:M].view(U, Lp, H, D).transpose(1, 2) for t in (q, k, v))  # (U, heads, Lp, head_dim)
        p = torch.softmax((qp @ kp.transpose(-1, -2)) * attn.scaling + prompt_bias, -1, dtype=soft_dtype)
        a_prompts = (p.to(dtype) @ vp).transpose(1, 2).reshape(M, H * D)
        # the continuations, against their prompt and themselves
        if not grouped:
            kp, vp = kp.index_select(0, u), vp.index_select(0, u)
        qr, kr, vr = (_spread(t[M:], place, Ur, Gr, Lr) for t in (q, k, v))  # (Ur, heads, Gr, Lr, head_dim)
        # a group's G rows meet their prompt's keys in one product: (U, heads, G * Lr, head_dim) @ (U, heads, ., Lp)
        to_prompt = (qr.view(Ur, H, Gr * Lr, D) @ kp.transpose(-1, -2)).view(Ur, H, Gr, Lr, Lp)
        scores = torch.cat([to_prompt, qr @ kr.transpose(-1, -2)], -1) * attn.scaling + rest_bias
        p = torch.softmax(scores, -1, dtype=soft_dtype).to(dtype)  # (Ur, heads, Gr, Lr, Lp + Lr)
        a = (p[..., :Lp].reshape(Ur, H, Gr * Lr, Lp) @ vp).view(Ur, H, Gr, Lr, D) + p[..., Lp:] @ vr
        a_rest = a.view(-1, D).index_select(0, place).view(N, H * D)  # back to the tokens: (N, heads * head_dim)
        a = torch.cat([a_prompts, a_rest])
        if i < top:
            h = h + attn.o_proj(a)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = _top_and_head(lm, lm.model.layers[top], h, a, U, Lp, prompt_grad)
    return logits[:M].view(U, Lp, -1), logits[M:], where


def _top_and_head(lm: nn.Module, layer, h: torch.Tensor, a: torch.Tensor, U: int, Lp: int, prompt_grad: bool):
    """The (M + N, vocab) logits: the top ``layer``'s output projection and MLP, from its input ``h`` and attention
    output ``a`` (M + N rows, the prompts' first), then the LM head. With ``prompt_grad=False``, with a graph for
    each prompt's last column and the continuations only, and without one for the other prompt positions."""

    def head(x, y):
        x = x + layer.self_attn.o_proj(y)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return lm.lm_head(lm.model.norm(x))

    if prompt_grad:
        return head(h, a)
    dev = h.device
    last = torch.arange(U, device=dev) * Lp + Lp - 1
    graph = torch.cat([last, torch.arange(U * Lp, len(h), device=dev)])
    other = torch.ones(U * Lp, dtype=torch.bool, device=dev)
    other[last] = False
    other = other.nonzero().squeeze(1)
    with torch.no_grad():
        no_graph = head(h.index_select(0, other), a.index_select(0, other))
    with_graph = head(h.index_select(0, graph), a.index_select(0, graph))
    logits = with_graph.new_empty(len(h), with_graph.shape[1]).index_copy_(0, other, no_graph)
    return logits.index_copy(0, graph, with_graph)  # out of place: the gradient reaches the graph's rows


def _spread(t: torch.Tensor, place: torch.Tensor, U: int, G: int, Lr: int) -> torch.Tensor:
    """(N, heads, head_dim) tokens -> (U, heads, G, Lr, head_dim), zeros at the padding, each token's head h at
    row ``place[n * heads + h]`` of the flattening (differentiably: the gradient is gathered back)."""
    N, H, D = t.shape
    return t.new_zeros(U * H * G * Lr, D).index_copy(0, place, t.reshape(N * H, D)).view(U, H, G, Lr, D)
