"""Batched sampling with a KV cache and per-token log-probs (Chapter 6).

An RL trainer needs more than text from its sampler: for every sampled token it
needs the log-prob under the distribution the token was actually drawn from,
because that is the ``sampling_logprobs`` (``q``) in the importance ratio
``exp(logprobs - sampling_logprobs)`` of Chapter 7.

How it works (shapes: P prompts, G samples each, B = P*G rows)::

    left-pad the P prompts             input_ids (P, L), attention_mask (P, L)
    position ids from the mask         (P, L): padding does not shift positions
    prefill once                       KV cache for P rows, next-token logits (P, V)
    G rows per prompt                  (B, ...): each prompt is encoded once, not G times
    loop over max_tokens:
        logp = log_softmax(logits / temperature)           (B_active, V)
        draw a token (greedy when temperature == 0)        record it and logp[token]
        drop rows that produced a stop sequence            the cache shrinks with them
        feed the tokens back with the next position ids

Rows that finish are removed from the batch, so a group whose answers are short
costs less than one padded to ``max_tokens``. For Llama and Qwen2 models the fed-back tokens go through
:mod:`edurl.llm.decode`, which keeps each prompt's keys and values once for its G rows; other models get their
cache repeated G times and their own forward at every step.

Multi-turn episodes (Chapter 9) send the sampler a conversation that grows by a reply and an answer each turn.
With a :class:`PrefixCache`, a row that finishes leaves its keys and values behind under its conversation's key,
and the next turn's prefill runs only the tokens that the cached ones do not cover::

    turn k:      [prompt_k | reply_k]                  prefill len(prompt_k) positions, keep the KV
    turn k + 1:  [cached KV | reply_k[-1], answer, ...] prefill only the new tokens

A prompt that does not begin with the cached tokens (a renderer that re-encodes earlier turns differently) is
prefilled whole, as without the cache, so the cache never conditions on tokens the prompt does not contain.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from edurl._checks import is_whole
from edurl.llm.decode import fast_decoder
from edurl.llm.padding import pad
from edurl.llm.policy import refuse_prompt_learning
from edurl.llm.shared_prefix import CACHE_ARG, at_least_float32
from edurl.utils import warn_at_caller


@dataclass
class SamplingParams:
    """How to draw a completion."""

    max_tokens: int = 32
    """Most tokens to generate per completion (the stop sequence included)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy. RL needs > 0 for groups to differ."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens with this much probability."""
    stop: list[int] | list[list[int]] = field(default_factory=list)
    """Token ids, or token-id sequences, that end a completion (kept in the output)."""
    seed: int | None = None
    """Seed for this call's random draws; None uses torch's global generator."""

    def __post_init__(self) -> None:
        if not is_whole(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        self.max_tokens = int(self.max_tokens)  # a NumPy int too; a plain int travels to the server as JSON
        if not 0 <= self.temperature < math.inf:  # at inf every token is equally likely
            raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature!r}")
        if 0 < self.temperature < 1e-6:
            raise ValueError(
                f"temperature {self.temperature!r} is greedy in all but name, and logits / temperature can overflow "
                "to inf (NaN log-probs) below about 1e-36; use temperature=0 for greedy decoding"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if (
            isinstance(self.stop, (str, bytes))
            or not isinstance(self.stop, (list, tuple))
            or not all(is_whole(s) or (isinstance(s, (list, tuple)) and all(map(is_whole, s))) for s in self.stop)
        ):
            raise TypeError(
                f"stop must be a list of token ids or of token-id sequences, e.g. renderer.get_stop_sequences() or "
                f"[tokenizer.eos_token_id], got {self.stop!r}; to stop at a string, encode it to ids first"
            )

    def stop_sequences(self) -> list[list[int]]:
        """``stop`` as a list of token-id sequences."""
        seqs = [[int(s)] if is_whole(s) else [int(t) for t in s] for s in self.stop]
        if any(len(s) == 0 for s in seqs):
            raise ValueError("stop sequences must not be empty")
        return seqs


@dataclass
class Completion:
    """One sampled completion (the prompt is not included)."""

    tokens: list[int]
    """The sampled token ids, ending with the stop sequence when one was produced."""
    logprobs: list[float]
    """``log q(token)`` for each token, at the sampling temperature (temperature 1 when greedy)."""
    stop_reason: str
    """'stop' if a stop sequence ended it, 'length' if it hit ``max_tokens``."""
    prompt_index: int
    """Which prompt it continues."""


class PrefixCache:
    """Keys and values of each conversation's last sampled turn, for :func:`sample`'s ``prefix_cache``.

    An entry holds the tokens the model has run for one conversation (its prompt and its reply, all but the
    reply's last token, which was drawn and never fed back) and, per layer, their keys and values (heads, tokens,
    head_dim) with the padding removed. ``hits`` and ``misses`` count prompts that did and did not extend their
    entry; ``saved_tokens`` counts the prompt tokens that were not run again.

    The keys and values belong to the weights that computed them: use one cache per set of weights
    (``do_group_rollouts`` makes one per rollout), never across an optimizer step."""

    def __init__(self) -> None:
        self.entries: dict[Hashable, tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.hits = self.misses = self.saved_tokens = 0

    def lookup(self, key: Hashable, prompt: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """(number of cached tokens, their per-layer keys and values) for ``prompt``; (0, None) when the entry is
        missing or ``prompt`` does not strictly extend its tokens."""
        entry = self.entries.get(key)
        if entry is None:
            return 0, None
        tokens, kv = entry
        n = len(tokens)
        if n >= len(prompt) or prompt[:n] != tokens:
            self.misses += 1
            return 0, None
        self.hits += 1
        self.saved_tokens += n
        return n, kv

    def __len__(self) -> int:
        return len(self.entries)


def _layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (keys, values), (B, heads, T, head_dim), in the layouts of transformers 4.x and 5.x."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _seed_cache(model: PreTrainedModel, rows: list[list[tuple[torch.Tensor, torch.Tensor]] | None], device):
    """A DynamicCache holding each row's cached keys and values, right-aligned in a (B, heads, Lc, head_dim) block,
    and its (B, Lc) mask (0 on the left padding of shorter rows)."""
    lengths = [0 if kv is None else kv[0][0].shape[1] for kv in rows]
    width = max(lengths)
    mask = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    first = next(kv for kv in rows if kv is not None)
    for layer, (k0, v0) in enumerate(first):
        keys = k0.new_zeros(len(rows), k0.shape[0], width, k0.shape[2])
        values = v0.new_zeros(len(rows), v0.shape[0], width, v0.shape[2])
        for b, kv in enumerate(rows):
            if kv is not None:
                keys[b, :, width - lengths[b] :] = kv[layer][0]
                values[b, :, width - lengths[b] :] = kv[layer][1]
        cache.update(keys, values, layer)
    for b, n in enumerate(lengths):
        if n:
            mask[b, width - n :] = 1
    return cache, mask


def embedding_rows(model) -> int | None:
    """The number of token ids ``model`` can embed: its input embedding's rows (a Hugging Face checkpoint may have
    more than its tokenizer's ids), read from the weight, which peft's wrappers of an adapted embedding keep too;
    None if the model shows no such weight."""
    weight = getattr(model.get_input_embeddings(), "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.ndim == 2 else None


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int | None = None) -> list[list[int]]:
    """Validate a batch of token-id prompts and return them as lists; with ``vocab_size`` (the model's embedding
    rows), also that every id is one the model has."""
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(
            "prompts must be a non-empty list of token-id lists, e.g. [renderer.build_generation_prompt(msgs)]"
        )
    out = []
    for i, p in enumerate(prompts):
        p = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; a completion needs at least one prompt token to condition on")
        if not all(isinstance(t, int) for t in p):
            raise TypeError(f"prompt {i} must hold int token ids, got {p[:5]!r}...")
        if vocab_size is not None and not all(0 <= t < vocab_size for t in p):
            bad = next(t for t in p if not 0 <= t < vocab_size)
            raise ValueError(
                f"prompt {i} holds token id {bad}, and the model has ids 0..{vocab_size - 1} only: was the prompt "
                "encoded with another tokenizer than the model's? (a model built for one tokenizer needs its ids)"
            )
        out.append(p)
    return out


def warn_past_positions(model, length: int, what: str) -> None:
    """Warn when a sequence of ``length`` tokens reaches past the model's ``max_position_embeddings``: rotary
    positions compute past it without an error, but the model never trained there, so what it writes or scores
    there means little. The text names no length, so a loop of varying prompts warns once, not every step."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and length > limit:
        warn_at_caller(
            f"{what} can reach past the model's max_position_embeddings ({limit}): positions past it were never "
            "trained. Shorten the prompts, lower max_tokens, or build the model with a larger "
            "max_position_embeddings (TinyLMConfig(max_position_embeddings=...)).",
        )


def _draw(logits: torch.Tensor, params: SamplingParams, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return (tokens (B,), their log-probs (B,))."""
    logits = at_least_float32(logits)
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)  # (B, V)
        tokens = logp.argmax(dim=-1)
    else:
        logp = torch.log_softmax(logits / params.temperature, dim=-1)  # (B, V)
        probs = logp.exp()
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            outside = sorted_p.cumsum(-1) - sorted_p >= params.top_p  # mass before this token already >= top_p
            sorted_p = sorted_p.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def model_eos_ids(model: PreTrainedModel) -> list[int]:
    """The end-of-sequence ids a model declares: its generation config's ``eos_token_id``, else its config's
    (an int, a list of ints, or None)."""
    for config in (getattr(model, "generation_config", None), model.config):
        eos = getattr(config, "eos_token_id", None) if config is not None else None
        if eos is not None:
            return [eos] if isinstance(eos, int) else [int(e) for e in eos]
    return []


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    num_samples: int = 1,
    params: SamplingParams | None = None,
    pad_token_id: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    prefix_cache: PrefixCache | None = None,
    cache_keys: Sequence[Hashable] | None = None,
    fast_decode: bool = True,
) -> list[Completion]:
    """Sample ``num_samples`` completions for each prompt.

    A completion ends at the first of ``params.stop`` or an end-of-sequence token: ``eos_token_id``, or when
    it is None, the ids the model declares (:func:`model_eos_ids`), so a real chat model whose EOS differs
    from the renderer's stop token still stops. Pass ``eos_token_id=[]`` to stop on ``params.stop`` only.

    Returns ``len(prompts) * num_samples`` completions, prompt-major: completion
    ``i * num_samples + j`` is sample ``j`` of prompt ``i``.

    The reported log-probs are ``log_softmax(logits / temperature)`` at the
    sampled token -- exactly what a trainer recomputes from the same weights.
    With ``top_p < 1`` the draw is from a truncated distribution, which these
    log-probs do not reflect; RL recipes keep ``top_p = 1`` for that reason.

    ``prefix_cache`` and ``cache_keys`` (one hashable per prompt, e.g. an episode's index; ``num_samples`` must be 1)
    reuse the keys and values of the conversation's earlier turn when the prompt extends it, and store this turn's
    (see the module docstring). The draws are the same as without the cache up to floating-point rounding.

    ``fast_decode`` runs the decode steps of a Llama or Qwen2 model layer by layer (:mod:`edurl.llm.decode`: each
    prompt's keys and values kept once for its ``num_samples`` rows, each completion's in a buffer reserved for
    ``max_tokens``) instead of calling the model's forward once per token; the logits are the same up to
    floating-point rounding. ``False``, or a model it does not know, calls the forward every step.
    """
    refuse_prompt_learning(model, "sample")
    params = params or SamplingParams()
    prompts = check_prompts(prompts, embedding_rows(model))
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    warn_past_positions(
        model, max(map(len, prompts)) + params.max_tokens, f"a prompt plus max_tokens={params.max_tokens}"
    )
    stops = params.stop_sequences()
    eos = (
        model_eos_ids(model)
        if eos_token_id is None
        else ([eos_token_id] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id])
    )
    stops += [[e] for e in eos if [e] not in stops]
    if prefix_cache is not None:
        if cache_keys is None or len(cache_keys) != len(prompts):
            raise ValueError(
                f"prefix_cache needs one cache key per prompt: got {None if cache_keys is None else len(cache_keys)} "
                f"keys for {len(prompts)} prompts"
            )
        if num_samples != 1:
            raise ValueError(
                f"prefix_cache keeps one conversation per key, so num_samples must be 1, got {num_samples}"
            )
        config = getattr(model, "config", None)
        layer_types = getattr(config, "layer_types", None)
        if (
            getattr(config, "use_sliding_window", False)
            or any(t != "full_attention" for t in layer_types or ())
            or (layer_types is None and getattr(config, "sliding_window", None) is not None)  # Mistral's configs
        ):
            raise ValueError(
                "prefix_cache keeps each conversation's keys and values whole, and this model has sliding-window "
                "attention layers, whose cache keeps only the last window: sample without it (prefix_cache=None; "
                "MultiTurnConfig(prefix_cache=False))"
            )
    device = next(model.parameters()).device
    if pad_token_id is None:
        pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)

    was_training = model.training
    model.eval()
    # ---- prefill each prompt once (only its tokens past a cached prefix) ---------------------------
    found = [prefix_cache.lookup(k, p) for k, p in zip(cache_keys, prompts)] if prefix_cache is not None else []
    if any(kv is not None for _, kv in found):
        cache, cached_mask = _seed_cache(model, [kv for _, kv in found], device)  # (P, Lc)
        new, new_mask = pad([p[n:] for p, (n, _) in zip(prompts, found)], pad_token_id, side="left", device=device)
        start = torch.tensor([n for n, _ in found], device=device)[:, None]  # (P, 1): first new token's position
        positions = start + (new_mask.cumsum(-1) - 1).clamp(min=0)  # (P, W)
        mask = torch.cat([cached_mask, new_mask], dim=1)  # (P, Lc + W)
        out = model(input_ids=new, attention_mask=mask, position_ids=positions, use_cache=True, **{CACHE_ARG: cache})
    else:
        ids, mask = pad(prompts, pad_token_id, side="left", device=device)  # (P, L)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (P, L): first real token is position 0
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{CACHE_ARG: cache})
    logits = out.logits[:, -1]  # (P, V)
    # ---- G copies of every row -----------------------------------------------------------------
    G, B = num_samples, len(prompts) * num_samples
    T = params.max_tokens
    decoder = fast_decoder(model) if fast_decode else None
    if decoder is not None:  # each prompt's keys and values stay once; the completions get buffers of their own
        decoder.load([_layer_kv(cache, layer) for layer in range(len(cache))], mask, G, T)
    else:
        cache.batch_repeat_interleave(G)
    logits = logits.repeat_interleave(G, dim=0)  # (B, V)
    mask = mask.repeat_interleave(G, dim=0)  # (B, L)
    next_pos = positions[:, -1].repeat_interleave(G, dim=0) + 1  # (B,)

    def row_kv(r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Live row ``r``'s keys and values per layer, (heads, columns, head_dim)."""
        if decoder is not None:
            return decoder.row_kv(r)
        return [tuple(x[r] for x in _layer_kv(cache, layer)) for layer in range(len(cache))]

    out_tokens = torch.full((B, T), pad_token_id, dtype=torch.long, device=device)
    wide = next(model.parameters()).dtype == torch.float64  # a float64 model's log-probs stay float64 (_draw)
    out_logprobs = torch.zeros((B, T), dtype=torch.float64 if wide else torch.float32, device=device)
    lengths = torch.full((B,), T, dtype=torch.long, device=device)
    stopped = torch.zeros(B, dtype=torch.bool, device=device)
    active = torch.arange(B, device=device)  # rows still generating

    def keep_kv(rows: torch.Tensor, t: int) -> None:
        """Store the keys and values of batch rows ``rows`` (positions in ``active``) after ``t`` fed tokens."""
        for r in rows.tolist():
            b = int(active[r])
            real = mask[r].bool()
            kv = [tuple(x[:, real] for x in layer) for layer in row_kv(r)]
            prefix_cache.entries[cache_keys[b]] = (prompts[b] + out_tokens[b, :t].tolist(), kv)

    stop_ids = [torch.tensor(seq, device=device) for seq in stops]  # once: a copy to the GPU waits for it
    for t in range(T):
        tokens, logp = _draw(logits, params, generator)  # (A,), (A,)
        out_tokens[active, t] = tokens
        out_logprobs[active, t] = logp
        done = torch.zeros_like(tokens, dtype=torch.bool)
        for seq in stop_ids:
            k = len(seq)
            if t + 1 >= k:
                tail = out_tokens[active, t + 1 - k : t + 1]  # (A, k)
                done |= (tail == seq).all(-1)
        if done.any():
            if prefix_cache is not None:
                keep_kv(done.nonzero().squeeze(-1), t)
            lengths[active[done]] = t + 1
            stopped[active[done]] = True
            keep = ~done
            if not keep.any():
                break
            keep_idx = keep.nonzero().squeeze(-1)
            if decoder is not None:
                decoder.select(keep_idx)
            else:
                cache.batch_select_indices(keep_idx)
            active, tokens, mask, next_pos = active[keep], tokens[keep], mask[keep], next_pos[keep]
        if t == T - 1:
            if prefix_cache is not None:
                keep_kv(torch.arange(len(active), device=device), t)
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (A, L + t + 1)
        if decoder is not None:
            logits = decoder.step(tokens, next_pos)
        else:
            out = model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                use_cache=True,
                **{CACHE_ARG: cache},
            )
            logits = out.logits[:, -1]
        next_pos = next_pos + 1
    model.train(was_training)

    tokens_cpu, logprobs_cpu, lengths_cpu, stopped_cpu = (x.cpu() for x in (out_tokens, out_logprobs, lengths, stopped))
    return [
        Completion(
            tokens=tokens_cpu[b, : lengths_cpu[b]].tolist(),
            logprobs=logprobs_cpu[b, : lengths_cpu[b]].tolist(),
            stop_reason="stop" if stopped_cpu[b] else "length",
            prompt_index=b // G,
        )
        for b in range(B)
    ]
