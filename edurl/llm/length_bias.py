"""GRPO's length bias, as a run (Chapter 7, section 4).

``seq_mean_token_mean`` (GRPO's aggregation) divides each completion's loss by its own length. A wrong
completion (negative advantage) of ``L`` tokens is therefore pushed down with weight ``1/L`` per token: the
longer it is, the less each of its tokens is punished, so the policy learns that *when it is wrong, it
should be long* (Liu et al., 2025, "Understanding R1-Zero-Like Training", Dr. GRPO). A right completion is
pushed up with ``1/L`` per token, so right answers get shorter. A constant divisor (``sum``,
``seq_mean_token_sum_norm``) weighs every token the same and has no such pull.

The real arithmetic run cannot show this: its SFT start writes ``\\boxed{N}`` and stops, so its completion
lengths barely vary. This module isolates the effect in the smallest policy where length is free. A
completion is::

    position   0          1 .. k-1        k
    token      answer     filler ...      <eos>          (cut at max_tokens, like the sampler)
               right or   each step: stop with probability p_c, where c is the answer given
               wrong

The policy has three logits: the answer's (``P(right)``) and one stop logit per kind of answer, because an
LM sees its own answer before it decides to stop. Each step samples ``batch_size`` groups of ``group_size``
completions; the reward is 1 for the right answer and 0 otherwise; then it runs exactly the library's
pieces: :func:`~edurl.llm.losses.group_advantages`, the ``importance_sampling`` per-token loss, and
:func:`~edurl.llm.losses.aggregate` with the mode under study, and one Adam step.

Logged per step, with the names of :func:`edurl.llm.grpo.grpo_step`: ``env/all/correct``,
``env/all/ac_tokens_per_turn`` (mean sampled length), and the exact expected lengths of a wrong and of a
right completion under the current policy, ``length/wrong`` and ``length/right`` (no sampling noise).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F

from edurl._checks import is_whole
from edurl.llm import losses as L
from edurl.utils import progress as progress_bar
from edurl.utils import torch_threads


@dataclass
class LengthBiasConfig:
    """A length-bias run: the toy policy, the batch and the optimizer."""

    aggregation: str = "seq_mean_token_mean"
    """The aggregation under study (edurl.llm.losses.AGGREGATION_MODES)."""
    steps: int = 100
    """GRPO iterations."""
    batch_size: int = 8
    """P: groups per step."""
    group_size: int = 8
    """G: completions per group."""
    learning_rate: float = 0.05
    """Adam learning rate on the three logits."""
    max_tokens: int = 16
    """Most tokens per completion (answer, fillers, stop); also Dr. GRPO's fixed divisor."""
    p_right: float = 0.3
    """P(right answer) at the start."""
    p_stop: float = 0.3
    """Probability of stopping at each step after the answer, at the start (both kinds of answer)."""
    seed: int = 0
    """Seeds the sampling."""
    num_threads: int = 1
    """torch CPU threads: the tensors are tiny, so more threads only add overhead (about 20x with another
    process busy on a 2-core machine)."""

    def __post_init__(self) -> None:
        if self.aggregation not in L.AGGREGATION_MODES:
            raise ValueError(f"aggregation must be one of {L.AGGREGATION_MODES}, got {self.aggregation!r}")
        for name in ("steps", "batch_size", "group_size", "max_tokens"):
            value = getattr(self, name)
            if not is_whole(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            setattr(self, name, int(value))  # a NumPy int too, stored as a Python one
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2: a group of one has advantage 0 after centring")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2 (an answer and a stop token), got {self.max_tokens}")
        for name in ("p_right", "p_stop"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be a probability strictly between 0 and 1, got {getattr(self, name)!r}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be a finite number > 0, got {self.learning_rate!r}")


def expected_length(stop_logit: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """Exact mean length (answer + fillers + stop, cut at ``max_tokens``) when each step after the answer
    stops with probability ``sigmoid(stop_logit)``.

    The completion has at least ``j + 1`` tokens (j = 1 .. max_tokens - 1) iff the first ``j - 1`` steps
    did not stop, so ``E[L] = 1 + sum_{j=1}^{M} (1 - p)^(j-1)`` with ``M = max_tokens - 1``.
    By hand: ``p = 0.5, max_tokens = 3`` gives ``1 + 1 + 0.5 = 2.5``.
    """
    p = torch.sigmoid(stop_logit)
    j = torch.arange(max_tokens - 1, dtype=p.dtype, device=p.device)  # j - 1 = 0 .. M - 1
    return 1 + ((1 - p).unsqueeze(-1) ** j).sum(-1)


def sample_completions(
    answer_logit: torch.Tensor, stop_logits: torch.Tensor, n: int, max_tokens: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw ``n`` completions. Returns ``right`` (n,) bool, ``lengths`` (n,) long (tokens, at most
    ``max_tokens``) and ``stopped`` (n,) bool (False when cut at ``max_tokens`` before the stop token)."""
    dtype = stop_logits.dtype
    right = torch.rand(n, generator=generator, dtype=dtype) < torch.sigmoid(answer_logit)
    p = torch.sigmoid(stop_logits)[right.long()]  # (n,): this answer's stop probability
    # fillers before the stop token ~ Geometric(p) by inversion: floor(log U / log(1 - p))
    u = torch.rand(n, generator=generator, dtype=dtype).clamp_min(torch.finfo(dtype).tiny)
    # clamped while still a float: a stop probability under about 1e-18 draws more fillers than an int64 holds
    # (or inf), which .long() would wrap to a negative length; past max_tokens the length is cut there anyway
    fillers = torch.floor(torch.log(u) / torch.log1p(-p)).clamp_max(max_tokens).long()
    full = 2 + fillers  # answer + fillers + stop
    return right, full.clamp_max(max_tokens), full <= max_tokens


def completion_logprobs(
    answer_logit: torch.Tensor,
    stop_logits: torch.Tensor,
    right: torch.Tensor,
    lengths: torch.Tensor,
    stopped: torch.Tensor,
    max_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs ``(n, max_tokens)`` of the sampled completions and their mask (1 on each token)."""
    pos = torch.arange(max_tokens, device=lengths.device)  # (T,)
    mask = (pos < lengths[:, None]).to(stop_logits.dtype)  # (n, T)
    is_stop = (pos == lengths[:, None] - 1) & stopped[:, None]  # (n, T): the stop token, if it was sampled
    answer = torch.where(right, F.logsigmoid(answer_logit), F.logsigmoid(-answer_logit))  # (n,)
    stop = stop_logits[right.long()]  # (n,)
    after = torch.where(is_stop, F.logsigmoid(stop)[:, None], F.logsigmoid(-stop)[:, None])  # (n, T)
    return torch.where(pos == 0, answer[:, None], after), mask


def length_bias_run(config: LengthBiasConfig | None = None) -> pd.DataFrame:
    """One run; a DataFrame with one row per step (step 0 is the start, before any update)."""
    config = config or LengthBiasConfig()
    with torch_threads(config.num_threads):
        return _train(config)


def _train(c: LengthBiasConfig) -> pd.DataFrame:
    generator = torch.Generator().manual_seed(c.seed)
    logit = lambda q: math.log(q / (1 - q))  # noqa: E731
    answer_logit = torch.tensor(logit(c.p_right), dtype=torch.float64, requires_grad=True)
    stop_logits = torch.full((2,), logit(c.p_stop), dtype=torch.float64, requires_grad=True)  # [wrong, right]
    optimizer = torch.optim.Adam([answer_logit, stop_logits], lr=c.learning_rate)
    P, G = c.batch_size, c.group_size
    rows = []
    for step in range(c.steps + 1):
        with torch.no_grad():
            right, lengths, stopped = sample_completions(answer_logit, stop_logits, P * G, c.max_tokens, generator)
            wrong_len, right_len = expected_length(stop_logits, c.max_tokens).tolist()
        rows.append(
            {
                "step": step,
                "env/all/correct": float(right.double().mean()),
                "env/all/ac_tokens_per_turn": float(lengths.double().mean()),
                "length/wrong": wrong_len,
                "length/right": right_len,
                "p_right": float(torch.sigmoid(answer_logit.detach())),
            }
        )
        if step == c.steps:
            break
        logprobs, mask = completion_logprobs(answer_logit, stop_logits, right, lengths, stopped, c.max_tokens)
        advantages = L.group_advantages(right.double().view(P, G)).view(P * G, 1).expand_as(logprobs)  # (PG, T)
        per_token = L.get_loss_fn("importance_sampling")(logprobs, logprobs.detach(), advantages)  # on-policy
        loss = L.aggregate(per_token, mask, c.aggregation, max_tokens=c.max_tokens)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return pd.DataFrame(rows)


def length_bias_study(
    aggregations: Sequence[str] = ("seq_mean_token_mean", "seq_mean_token_sum_norm"),
    seeds: Sequence[int] = range(10),
    progress: bool = True,
    **overrides,
) -> pd.DataFrame:
    """:func:`length_bias_run` for every aggregation and seed; one long DataFrame with ``aggregation`` and
    ``seed`` columns. ``overrides`` are :class:`LengthBiasConfig` fields."""
    runs = [(a, s) for a in aggregations for s in seeds]
    frames = []
    for aggregation, seed in progress_bar(runs, desc="length-bias runs", disable=not progress):
        frame = length_bias_run(LengthBiasConfig(aggregation=aggregation, seed=seed, **overrides))
        frames.append(frame.assign(aggregation=aggregation, seed=seed))
    return pd.concat(frames, ignore_index=True)


def plot_length_bias(study: pd.DataFrame, axes=None):
    """Median (line) and min-max (band) over seeds of the expected wrong and right lengths, the mean sampled
    length ``env/all/ac_tokens_per_turn`` and the fraction right, one colour per aggregation."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 4, figsize=(16, 3.2))
    panels = [
        ("length/wrong", "expected length of a wrong completion"),
        ("length/right", "expected length of a right completion"),
        ("env/all/ac_tokens_per_turn", "ac_tokens_per_turn (all, sampled)"),
        ("env/all/correct", "fraction right (sampled)"),
    ]
    for ax, (key, title) in zip(axes, panels):
        for aggregation, frame in study.groupby("aggregation", sort=False):
            by_step = frame.pivot(index="step", columns="seed", values=key)
            (line,) = ax.plot(by_step.index, by_step.median(axis=1), label=aggregation)
            ax.fill_between(by_step.index, by_step.min(axis=1), by_step.max(axis=1), color=line.get_color(), alpha=0.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
    axes[0].set_ylabel("tokens")
    axes[0].legend(fontsize=8)
    return axes


__all__ = [
    "LengthBiasConfig",
    "completion_logprobs",
    "expected_length",
    "length_bias_run",
    "length_bias_study",
    "plot_length_bias",
    "sample_completions",
]
