"""The sampler's decode step for Llama-family models: a group's prompt kept once, the completions in reserved buffers.

The sampler (:func:`edurl.llm.sampling.sample`) runs the P prompts through the model's own forward (the prefill),
then feeds back one token per row per step for B = P * G rows. Calling the model's forward for each of those steps
copies more memory than the step computes: the KV cache of all B rows grows by a ``torch.cat`` of every layer's
keys and values, and each prompt's keys and values sit in it G times, once per sample of its group. Here:

* each prompt's keys and values stay as the prefill left them, once per prompt (P rows), not once per sample;
* each row's completion has its own buffer per layer, (B, kv_heads, room, head_dim), that a step writes one
  column of, in place; the room starts at up to 64 columns and doubles when a step needs more, up to
  ``max_tokens`` (reserving ``max_tokens`` columns up front would hold memory that rows which stop early never
  use: 3.2 GB for 64 rows of Qwen2.5-0.5B at 4,096 tokens in bf16);
* a step runs the layer's own modules (its norms, projections and MLP, LoRA adapters included) around the
  attention, which reads the two parts side by side::

    h = embed(tokens)                                              (A, hidden), A rows still generating
    for each layer:
        q, k, v = projections(norm(h)), rotated at each row's position
        completion_keys[:, :, j], completion_values[:, :, j] = k, v
        scores = [q . prompt_keys of the row's prompt | q . completion_keys[:, :, :j+1]] * scale
                 (the G queries of a group meet their prompt's keys in one matrix product)
        a = softmax(scores) @ [prompt_values | completion_values]
        h = h + o_proj(a);  h = h + mlp(norm(h))
    logits = lm_head(norm(h))

It is the same arithmetic as the model's forward in another order, so the logits agree up to floating-point
rounding (tests/llm/test_decode.py checks them to 1e-10 in float64 against the model with its own cache). This is
the decode-time twin of :mod:`edurl.llm.shared_prefix`, which runs a group's prompt once in training. Models it does
not know (another attention module, scaled rotary embeddings, sliding windows) get ``None`` from
:func:`fast_decoder`, and the sampler calls their forward every step.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

__all__ = ["GroupKV", "fast_decoder", "layer_by_layer_lm"]

_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def fast_decoder(model: nn.Module) -> GroupKV | None:
    """A :class:`GroupKV` for ``model`` when its decode step can run layer by layer here, else None.

    Supported: transformers' Llama and Qwen2 causal LMs (the course's tiny model, Qwen2.5, SmolLM2, Llama) with
    the default rotary embedding and full attention in every layer, plain or with peft's LoRA adapters."""
    lm = layer_by_layer_lm(model)
    return GroupKV(lm) if lm is not None else None


def layer_by_layer_lm(model: nn.Module) -> nn.Module | None:
    """The transformers causal LM inside ``model`` (under a peft wrapper, or ``model`` itself) when edurl can run
    its layers one by one from their modules, as :class:`GroupKV` and :mod:`edurl.llm.packed` do; else None.

    Supported: Llama and Qwen2 with the default rotary embedding and full attention in every layer, whose
    attention is the four projections and nothing else (no q/k norms), plain or with peft's LoRA adapters."""
    lm = _causal_lm(model)
    config = getattr(lm, "config", None)
    if getattr(config, "model_type", None) not in ("llama", "qwen2") or getattr(lm, "model", None) is None:
        return None
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return None
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return None
    if getattr(config, "use_sliding_window", False) or getattr(lm.model, "rotary_emb", None) is None:
        return None
    for layer in lm.model.layers:
        attn = layer.self_attn
        if {name for name, _ in attn.named_children()} != _ATTENTION_PARTS or getattr(attn, "sliding_window", None):
            return None  # e.g. q/k norms, or transformers < 4.48, whose attention holds its own rotary module
        if getattr(attn, "head_dim", None) is None or getattr(attn, "scaling", None) is None:
            return None
    return lm


class GroupKV:
    """The keys and values of P prompts (once each) and of the completions of their B = P * G rows, and the
    decode step that reads and writes them.

    :meth:`load` takes the prefill's cache, :meth:`step` feeds one token per row, :meth:`select` keeps some rows
    (the sampler drops rows that finished), :meth:`row_kv` gives one row's keys and values."""

    def __init__(self, lm: nn.Module):
        self.lm = lm
        self.embed = lm.model.embed_tokens
        self.layers = list(lm.model.layers)
        self.norm = lm.model.norm
        self.rotary = lm.model.rotary_emb
        self.head_dim = self.layers[0].self_attn.head_dim
        self.scaling = self.layers[0].self_attn.scaling
        dtype = self.embed.weight.dtype
        self.softmax_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    FIRST_ROOM = 64
    """Completion columns reserved by :meth:`load` (fewer if ``room`` is smaller); :meth:`step` doubles them."""

    def load(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, G: int, room: int) -> None:
        """Take the prefill's per-layer (keys, values), (P, kv_heads, L, head_dim), and its (P, L) mask (1 on real
        tokens, 0 on padding), for G samples of each prompt with up to ``room`` fed-back tokens each."""
        P, L = mask.shape
        self.G, self.B = G, P * G
        self.prompt_kv = list(layer_kv)
        self.prompt_bias = torch.zeros(P, L, dtype=layer_kv[0][0].dtype, device=mask.device)
        self.prompt_bias.masked_fill_(~mask.bool(), float("-inf"))  # (P, L): padding gets no attention
        self.room = room
        k0 = layer_kv[0][0]
        shape = (self.B, k0.shape[1], min(room, self.FIRST_ROOM), self.head_dim)
        # columns past ``length`` are never read, so the buffers start empty
        self.completion_kv = [(k0.new_empty(shape), k0.new_empty(shape)) for _ in layer_kv]
        self.rows = torch.arange(self.B, device=mask.device)  # each live row's index among the B
        self.length = 0  # completion columns written

    def _grow(self) -> None:
        """Double the completion buffers' columns (up to ``room``), keeping the ``length`` written."""
        n = self.length
        grown = []
        for k, v in self.completion_kv:
            A, H, cols, D = k.shape
            bigger = [x.new_empty(A, H, min(self.room, 2 * cols), D) for x in (k, v)]
            for new, old in zip(bigger, (k, v)):
                new[:, :, :n] = old[:, :, :n]
            grown.append(tuple(bigger))
        self.completion_kv = grown

    def select(self, keep: torch.Tensor) -> None:
        """Keep only live rows ``keep`` (positions among the live rows)."""
        self.rows = self.rows[keep]
        self.completion_kv = [(k[keep], v[keep]) for k, v in self.completion_kv]
        if self.G == 1:  # no prompt is shared: its rows go with their completions
            self.prompt_kv = [(k[keep], v[keep]) for k, v in self.prompt_kv]
            self.prompt_bias = self.prompt_bias[keep]
            self.rows = torch.arange(len(keep), device=keep.device)

    def row_kv(self, r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Live row ``r``'s keys and values per layer, (kv_heads, L + length, head_dim): its prompt's, then its own."""
        p = int(self.rows[r]) // self.G
        n = self.length
        return [
            (torch.cat([pk[p], ck[r, :, :n]], 1), torch.cat([pv[p], cv[r, :, :n]], 1))
            for (pk, pv), (ck, cv) in zip(self.prompt_kv, self.completion_kv)
        ]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed one token per live row, (A,), at position ids ``positions`` (A,); return the next-token logits."""
        j = self.length
        if j >= self.room:
            raise RuntimeError(f"GroupKV is full ({j} completion tokens): load it with more room")
        if j >= self.completion_kv[0][0].shape[2]:
            self._grow()
        A, D = tokens.shape[0], self.head_dim
        h = self.embed(tokens[:, None])  # (A, 1, hidden)
        cos, sin = self.rotary(h, positions[:, None])  # (A, 1, head_dim)
        cos, sin = cos[:, None], sin[:, None]  # (A, 1, 1, head_dim): broadcast over heads
        prompt_bias = self.prompt_bias[self.rows // self.G][:, None, None]  # (A, 1, 1, L)
        for layer, (pk, pv), (ck, cv) in zip(self.layers, self.prompt_kv, self.completion_kv):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(A, -1, 1, D)  # (A, heads, 1, head_dim)
            k = attn.k_proj(x).view(A, -1, 1, D)  # (A, kv_heads, 1, head_dim)
            v = attn.v_proj(x).view(A, -1, 1, D)
            q = q * cos + rotate_half(q) * sin
            ck[:, :, j : j + 1] = k * cos + rotate_half(k) * sin
            cv[:, :, j : j + 1] = v
            q = q.view(A, k.shape[1], -1, D)  # (A, kv_heads, groups, head_dim): grouped-query heads share a key
            scores = torch.cat([self._with_prompt(q, pk), (q[:, :, :, None] * ck[:, :, None, : j + 1]).sum(-1)], -1)
            p = torch.softmax(scores * self.scaling + _pad_right(prompt_bias, j + 1), -1, dtype=self.softmax_dtype)
            p = p.to(q.dtype)
            L = pk.shape[2]
            a = self._with_prompt(p[..., :L], pv, values=True) + (p[..., L:, None] * cv[:, :, None, : j + 1]).sum(-2)
            h = h + attn.o_proj(a.reshape(A, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.length = j + 1
        return self.lm.lm_head(self.norm(h))[:, 0]

    def _with_prompt(self, x: torch.Tensor, prompt: torch.Tensor, values: bool = False) -> torch.Tensor:
        """Each live row's ``x`` (A, kv_heads, groups, n) times its prompt's keys (n = head_dim: the scores, (A, kv_heads,
        groups, L)) or values (``values``, n = L: the prompt's share of the output, (A, kv_heads, groups, head_dim)).

        With G > 1 the rows of a group meet their prompt's (P, kv_heads, L, head_dim) in one matrix product per
        prompt and head, so each prompt's keys and values are read once, not G times (rows that finished are zeros)."""
        G = self.G
        if G == 1:  # one row per prompt, in the live rows' order: a product and a sum per row
            return (
                (x[..., None] * prompt[:, :, None]).sum(-2)
                if values
                else (x[:, :, :, None] * prompt[:, :, None]).sum(-1)
            )
        A, H, g, n = x.shape
        P = self.B // G
        if A < self.B:  # place the live rows among all B
            x = x.new_zeros(self.B, H, g, n).index_copy_(0, self.rows, x)
        x = x.view(P, G, H, g, n).transpose(1, 2).reshape(P, H, G * g, n)  # (P, kv_heads, G * groups, n)
        y = x @ (prompt if values else prompt.transpose(-1, -2))
        y = y.view(P, H, G, g, -1).transpose(1, 2).reshape(self.B, H, g, -1)
        return y if A == self.B else y[self.rows]


def _pad_right(bias: torch.Tensor, n: int) -> torch.Tensor:
    """``bias`` (..., L) followed by n zeros: the completion columns are all real tokens."""
    return torch.cat([bias, bias.new_zeros(*bias.shape[:-1], n)], -1)
