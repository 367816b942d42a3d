"""Training log-probs of a batch of datums, running a prompt that several completions share only once.

``TrainingClient.forward_backward`` and ``compute_logprobs`` call :func:`token_logprobs`. GRPO's G samples of
one problem share their prompt: every token before a row's first ``mask`` position. Scoring the rows whole
runs that prompt G times; here, when at most half the rows have distinct prompts, each prompt runs once and its
KV cache is copied to its completions::

    whole rows:     [prompt | completion 1]  ...  [prompt | completion G]      G * (Lp + Lc) positions
    shared prefix:  [prompt] -> KV cache -> [completion 1] ... [completion G]  Lp + G * Lc positions

The gradient still flows into the prompt's keys and values (the cache is copied differentiably: by ``expand`` for
rows grouped by prompt, by ``index_select`` otherwise), and the result equals whole-row scoring up to rounding
(tests/llm/test_shared_prefix.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from transformers import DynamicCache, LlamaForCausalLM, PreTrainedModel, cache_utils

from edurl.llm.packed import packed_logits
from edurl.llm.padding import pad
from edurl.objectives import entropy

__all__ = [
    "EAGER_ATTENTION_MAX_TOKENS",
    "LEAN_VOCAB",
    "Scores",
    "at_least_float32",
    "run_continuations",
    "run_prompts",
    "scaled_log_softmax",
    "short_row_attention",
    "token_logprobs",
]


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """A 16-bit float tensor as float32; float32 and float64 as they are (a float64 model's log-probs stay float64,
    which its gradient checks need)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def scaled_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) in fp32 or wider; temperature 0 (greedy) scores at 1, as the sampler
    reports."""
    logits = at_least_float32(logits)
    if temperature not in (0, 1):
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # a diagnostic: no gradient
        return entropy(logp)


LEAN_VOCAB = 4096
"""Logits over a vocabulary larger than this (every real checkpoint's: Qwen2.5 has 151,936 entries) are scored
without a float32 log-softmax of the whole (positions, vocabulary) tensor (:class:`Scores`)."""

LEAN_CHUNK_BYTES = 1 << 28
"""The lean path's float32 work tensors hold at most about this many bytes (256 MiB) at a time."""


class Scores:
    """The log-softmax of ``logits`` (..., V) at ``temperature``, read at (row, token) pairs, and its entropy.

    Rows index the flattened leading dimensions. Up to :data:`LEAN_VOCAB` entries the log-softmax is computed
    whole, as the course's tiny model always was. Past it, the float32 log-softmax of every position, which
    autograd keeps for the backward pass, and the entropy's temporaries were the largest tensors of a training
    step: about 20 bytes per position and vocabulary entry (3 MB a position for Qwen2.5), so a GRPO batch of
    32 x 4 replies of 512 tokens needed some 200 GB. The lean path keeps only the logits and each row's
    logsumexp, works through the rows in chunks, and gives the same numbers up to rounding."""

    def __init__(self, logits: torch.Tensor, temperature: float, with_entropy: bool):
        self.V = logits.shape[-1]
        self.ent = None
        if self.V <= LEAN_VOCAB:
            self.lean = False
            self.logp = scaled_log_softmax(logits, temperature)
            if with_entropy:
                self.ent = _entropy(self.logp).flatten()
            return
        self.lean = True
        self.logits = logits.reshape(-1, self.V)
        self.t = 1.0 if temperature in (0, 1) else float(temperature)
        self.lse, self.ent = _row_stats(self.logits, self.t, with_entropy)

    def at(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``log pi(tokens | row)`` for each pair, shaped like ``rows`` (and ``tokens``)."""
        if bool(((tokens < 0) | (tokens >= self.V)).any()):  # else a flat index reads another position's log-prob
            raise ValueError(  # (one host sync; the range is worked out only for the message)
                f"target tokens must be ids in [0, {self.V}), the vocabulary, got {int(tokens.min())}..{int(tokens.max())}"
            )
        if not self.lean:
            return self.logp.flatten()[rows * self.V + tokens]
        return _PickedLogprobs.apply(self.logits, rows.flatten(), tokens.flatten(), self.t, self.lse).view(rows.shape)

    def entropy(self, rows: torch.Tensor) -> torch.Tensor:
        """The entropy of each row's distribution (no gradient), shaped like ``rows``."""
        return self.ent[rows]


def _chunk_rows(V: int) -> int:
    return max(1, LEAN_CHUNK_BYTES // (4 * V))


@torch.no_grad()
def _row_stats(logits: torch.Tensor, t: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's logsumexp of ``logits / t`` in float32 or wider, and its entropy, a chunk of rows at a time."""
    N, V = logits.shape
    dtype = at_least_float32(logits[:0]).dtype
    lse = torch.empty(N, dtype=dtype, device=logits.device)
    ent = torch.empty(N, dtype=dtype, device=logits.device) if with_entropy else None
    step = _chunk_rows(V)
    for a in range(0, N, step):
        z = at_least_float32(logits[a : a + step])
        z = z / t if t != 1 else z
        lse[a : a + step] = torch.logsumexp(z, -1)
        if ent is not None:  # H = lse - sum p z, with 0 * z = 0 where p is 0
            p = torch.exp(z - lse[a : a + step, None])
            ent[a : a + step] = lse[a : a + step] - (p * torch.where(p > 0, z, 0.0)).sum(-1)
    return lse, ent


class _PickedLogprobs(torch.autograd.Function):
    """``logits[rows, tokens] / t - lse[rows]``, whose backward rebuilds each row's softmax a chunk at a time:
    d/dz_v of (z_c / t - lse) is (1[v = c] - softmax(z / t)_v) / t, summed over the pairs that read the row."""

    @staticmethod
    def forward(ctx, logits, rows, tokens, t, lse):
        ctx.save_for_backward(logits, rows, tokens, lse)
        ctx.t = t
        picked = at_least_float32(logits[rows, tokens])
        return (picked / t if t != 1 else picked) - lse[rows]

    @staticmethod
    @torch.autograd.function.once_differentiable  # its own backward is not differentiable: no second order
    def backward(ctx, grad):
        logits, rows, tokens, lse = ctx.saved_tensors
        t = ctx.t
        N, V = logits.shape
        weight = torch.zeros(N, dtype=grad.dtype, device=grad.device).index_add_(0, rows, grad)  # (N,)
        out = torch.empty_like(logits)
        step = _chunk_rows(V)
        for a in range(0, N, step):
            b = min(a + step, N)
            z = at_least_float32(logits[a:b])
            z = z / t if t != 1 else z
            g = torch.exp(z - lse[a:b, None]).mul_(-weight[a:b, None])  # -softmax x the row's summed gradient
            mine = (rows >= a) & (rows < b)
            g.index_put_((rows[mine] - a, tokens[mine]), grad[mine].to(g.dtype), accumulate=True)  # the 1[v = c]
            out[a:b] = g / t if t != 1 else g  # in float32 until here: one rounding to the logits' dtype
        return out, None, None, None, None


CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
"""The keyword under which a model's forward takes its KV cache in the installed transformers: ``cache`` in recent
5.x releases, which deprecate ``past_key_values`` and remove it in 5.40, and ``past_key_values`` before them."""


EAGER_ATTENTION_MAX_TOKENS = 48
"""Rows of at most this many tokens are scored with transformers' eager attention on the CPU (:func:`short_row_attention`)."""


_ATTENTION_READ_AT_EACH_CALL = hasattr(PreTrainedModel, "set_attn_implementation")
"""Whether this transformers release's attention reads ``config._attn_implementation`` at each call (the functional
attention of recent releases), so that :func:`short_row_attention` can switch it for one block."""


@contextmanager
def short_row_attention(model_config, length: int, device: torch.device) -> Iterator[None]:
    """Inside the block, the model of ``model_config`` attends with transformers' eager attention (two matrix
    products and a softmax) instead of ``sdpa`` when its rows are at most :data:`EAGER_ATTENTION_MAX_TOKENS` long
    and run on the CPU. :func:`token_logprobs` uses it for its shared-prefix passes when asked (``eager_short_rows``).

    The arithmetic is the same up to rounding; the speed is not. The completions' queries meet their prompts' keys
    through a mask that left-padded prompts of different lengths make irregular, and for short rows the fused
    kernel was slower there than eager attention, while for long rows it was faster (benchmarks/README.md, "The
    third cut"). On a GPU, and with transformers releases whose attention does not read the setting at each call,
    nothing changes."""
    switch = (
        _ATTENTION_READ_AT_EACH_CALL
        and device.type == "cpu"
        and length <= EAGER_ATTENTION_MAX_TOKENS
        and getattr(model_config, "_attn_implementation", None) == "sdpa"
    )
    if not switch:
        yield
        return
    model_config._attn_implementation = "eager"
    try:
        yield
    finally:
        model_config._attn_implementation = "sdpa"


def token_logprobs(
    forward: Callable[..., object],
    ids: torch.Tensor,
    attn: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool = True,
    pad_token_id: int = 0,
    model_config=None,
    eager_short_rows: bool = False,
    model: torch.nn.Module | None = None,
    prompt_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log pi(targets)`` at every position, (B, T), and the entropy of pi there (or None), both of the
    distribution at ``temperature`` (the one the sampler drew from).

    ``forward(**inputs)`` is the model's call (the policy's, or the reference's); ``ids``, ``attn``, ``targets``
    and ``mask`` are the (B, T) right-padded batch. Positions after a row's end hold 0. ``share_prompts=False``
    (e.g. under gradient checkpointing, which drops the KV cache) scores every row whole. ``model_config`` is
    the model's config, which the KV cache needs. ``eager_short_rows`` runs the shared-prefix passes under
    :func:`short_row_attention` (the training client's choice; whole rows keep the model's attention).
    ``model``, the module that ``forward`` calls, lets the prompts and the completions run packed, in one pass
    without the completions' padding (:func:`edurl.llm.packed.packed_logits`), when it is a model that runs layer by
    layer there and the rows are short (at most :data:`EAGER_ATTENTION_MAX_TOKENS`) on the CPU; pass it only when
    ``forward`` is that module's plain call (not, e.g., under a context that switches its LoRA adapter off).
    ``prompt_grad=False`` promises that the loss reads no log-prob before a row's first ``mask`` position (its own
    mask is 0 there, as in edurl's datums): the packed pass then returns those without a graph, and saves the top
    layer's backward pass over the prompts (:func:`edurl.llm.packed.packed_logits`).
    """
    if not share_prompts:
        return _whole_rows(forward, ids, attn, targets, with_entropy, temperature)
    B, T = ids.shape
    lengths = attn.sum(1)
    scored = mask != 0  # the loss counts every non-zero weight, 0.5 as well as 1
    has_loss = scored.any(1)
    first = torch.where(has_loss, scored.float().argmax(1), lengths - 1)  # (B,) first loss position
    prompts: dict[tuple[int, ...], int] = {}
    id_rows, ends = ids.tolist(), (first + 1).tolist()  # one copy to Python, not a select per row
    rows = [prompts.setdefault(tuple(id_rows[i][: ends[i]]), len(prompts)) for i in range(B)]
    if 2 * len(prompts) > B:  # too few repeats to pay for two passes
        return _whole_rows(forward, ids, attn, targets, with_entropy, temperature)
    dev = ids.device
    u = torch.tensor(rows, device=dev)  # (B,) row -> its prompt
    attention = (lambda: short_row_attention(model_config, T, dev)) if eager_short_rows else nullcontext
    rest = lengths - first - 1  # (B,) each row's tokens after its prompt
    Lr = int(rest.max())
    packed = None
    if Lr > 0 and model is not None and dev.type == "cpu" and T <= EAGER_ATTENTION_MAX_TOKENS:
        # the prompts and the completions in one pass, on their real tokens (edurl.llm.packed)
        pids, pmask = pad([list(p) for p in prompts], pad_token_id, side="left", device=dev)  # (U, Lp)
        j = torch.arange(Lr, device=dev)[None]
        rmask = j < rest[:, None]
        rids = ids.gather(1, (first[:, None] + 1 + j).clamp(max=T - 1)) * rmask  # (B, Lr) each row after its prompt
        packed = packed_logits(model, pids, pmask, u, rids, rmask, prompt_grad=prompt_grad)
    if packed is not None:
        logits_p = packed[0]
    else:
        # ---- each distinct prompt once, left-padded so that all of them end in the last column
        with attention():
            prefix = run_prompts(forward, list(prompts), pad_token_id, model_config, dev)
        if prefix is None:  # a model that ignored the cache: fall back rather than drop the prompt
            return _whole_rows(forward, ids, attn, targets, with_entropy, temperature)
        out_p, _, pmask, _ = prefix
        logits_p = out_p.logits
    scores_p = Scores(logits_p, temperature, with_entropy)
    Lp = pmask.shape[1]
    col = torch.arange(T, device=dev)[None]  # (1, T) positions of the datum layout
    f = first[:, None]
    # position c <= f of row i is prompt column Lp - 1 - f + c of prompt u_i
    in_prompt = col <= f
    pcol = (Lp - 1 - f + col).clamp(0, Lp - 1)
    lp = torch.where(in_prompt, scores_p.at(u[:, None] * Lp + pcol, targets), 0.0)
    ent = None
    if with_entropy:
        ent = torch.where(in_prompt, scores_p.entropy(u[:, None] * Lp + pcol), 0.0)
    # ---- every completion (the rest of its row) reads its prompt's cache
    if packed is not None:
        _, logits, where = packed  # (N, V) for the N completion tokens, and their flat indices into (B, Lr)
        scores_r = Scores(logits, temperature, with_entropy)
        r, c = where // Lr, first[where // Lr] + 1 + where % Lr  # each token's row and column in the datum layout
        n = torch.arange(logits.shape[0], device=dev)
        lp = lp.index_put((r, c), scores_r.at(n, targets[r, c]))  # out of place
        if with_entropy:
            ent = ent.index_put((r, c), scores_r.entropy(n))
    elif Lr > 0:
        j = torch.arange(Lr, device=dev)[None]  # (1, Lr)
        rmask = (j < rest[:, None]).long()
        rids = ids.gather(1, (f + 1 + j).clamp(max=T - 1)) * rmask
        with attention():
            out = run_continuations(forward, prefix, u, rids, rmask)
        scores_r = Scores(out.logits, temperature, with_entropy)  # (B, Lr, V)
        in_rest = (col > f) & (col < lengths[:, None])
        rcol = (col - f - 1).clamp(0, Lr - 1)
        ridx = torch.arange(B, device=dev)[:, None] * Lr + rcol
        lp = torch.where(in_rest, scores_r.at(ridx, targets), lp)
        if with_entropy:
            ent = torch.where(in_rest, scores_r.entropy(ridx), ent)
    return lp, ent


def run_prompts(forward, prompts: list, pad_token_id: int, model_config, device):
    """Run each of the U distinct ``prompts`` once, left-padded so that all of them end in the last column, and
    keep their KV cache. Returns ``(out, cache, pmask, ppos)``: the forward's output, the cache, the (U, Lp)
    attention mask and position ids; or None when the model ignored the cache (the caller scores rows whole)."""
    pids, pmask = pad([list(p) for p in prompts], pad_token_id, side="left", device=device)  # (U, Lp)
    ppos = (pmask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model_config)
    out = forward(input_ids=pids, attention_mask=pmask, position_ids=ppos, use_cache=True, **{CACHE_ARG: cache})
    if cache.get_seq_length() != pids.shape[1]:
        return None
    return out, cache, pmask, ppos


def run_continuations(forward, prefix, u: torch.Tensor, rest_ids: torch.Tensor, rest_mask: torch.Tensor):
    """Run each row's continuation ``rest_ids`` (B, Lr), right-padded with mask ``rest_mask``, against the cache
    of its prompt ``u[b]`` from :func:`run_prompts` (``prefix``). The cache's rows are copied differentiably
    (:func:`_give_rows_their_prompts`), so the gradient reaches the prompt's keys and values. Returns the forward's
    output."""
    _, cache, pmask, ppos = prefix
    _give_rows_their_prompts(cache, u)
    j = torch.arange(rest_ids.shape[1], device=rest_ids.device)[None]  # (1, Lr)
    return forward(
        input_ids=rest_ids,
        attention_mask=torch.cat([pmask[u], rest_mask], 1),
        position_ids=ppos[u, -1:] + 1 + j,
        use_cache=True,
        **{CACHE_ARG: cache},
    )


_PLAIN_REORDER = getattr(getattr(cache_utils, "DynamicLayer", None), "reorder_cache", None)
"""The per-layer ``reorder_cache`` that only indexes ``keys`` and ``values`` (recent transformers releases keep a cache
as layers; earlier ones keep lists, and :func:`_give_rows_their_prompts` leaves those to ``reorder_cache``)."""


def _give_rows_their_prompts(cache: DynamicCache, u: torch.Tensor) -> None:
    """Make row b of ``cache`` (one row per prompt) the keys and values of prompt ``u[b]``, one row per datum.

    GRPO's datums come in groups: the G rows of prompt 0, then the G rows of prompt 1, ... There each prompt's
    keys and values are repeated by ``expand``, whose backward pass sums the G rows' gradients (a reduction);
    the general ``index_select`` that ``reorder_cache`` uses backs into a ``scatter_add`` over the whole cache,
    about 1 ms for each layer's keys and each layer's values in a GRPO step's ``forward_backward`` at 2 threads
    (benchmarks/README.md, "The third cut"). Both give the same values, and gradients equal up to rounding."""
    layers = getattr(cache, "layers", None)
    U = int(u.max()) + 1
    G = len(u) // U
    grouped = (
        layers is not None
        and G * U == len(u)
        and all(type(layer).reorder_cache is _PLAIN_REORDER and layer.keys.shape[0] == U for layer in layers)
        and torch.equal(u, torch.arange(U, device=u.device).repeat_interleave(G))
    )
    if not grouped:
        cache.reorder_cache(u)
        return
    for layer in layers:
        for name in ("keys", "values"):
            kv = getattr(layer, name)  # (U, kv_heads, Lp, head_dim)
            setattr(layer, name, kv[:, None].expand(U, G, *kv.shape[1:]).reshape(U * G, *kv.shape[1:]))


def _whole_rows(forward, ids, attn, targets, with_entropy: bool, temperature: float):
    """One pass over every whole row: the reference that the shared-prefix path must equal."""
    scores = Scores(forward(input_ids=ids, attention_mask=attn).logits, temperature, with_entropy)
    rows = torch.arange(ids.numel(), device=ids.device).view(ids.shape)
    return scores.at(rows, targets), scores.entropy(rows) if with_entropy else None
