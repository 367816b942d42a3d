"""What every policy-gradient objective in the course shares: one clipped surrogate, one clip fraction and one
entropy, used by Chapter 5's PPO on CartPole (:mod:`edurl.rl.ppo`) and Chapter 7's LLM losses
(:mod:`edurl.llm.losses`) alike.

With ``lp = train_logprobs`` (the policy being trained), ``q = sampling_logprobs`` (the policy that sampled
the actions or tokens), ``A = advantages`` and the ratio ``r = exp(lp - q)``:

======================  ===========================================  ==========================================
name                    formula                                      shapes
======================  ===========================================  ==========================================
clipped_surrogate       -min(r * A, clamp(r, lo, hi) * A)            any shape, all three alike; same shape out
clipped_surrogate_grad  d clipped_surrogate / d lp: -r * A, or 0     as clipped_surrogate (the seed stack's
                        where the clip binds                         hand-written backward uses it)
clip_fraction           share of (masked) entries with r < lo or     any shape; a 0-d tensor
                        r > hi
entropy                 -sum_a exp(logp_a) * logp_a                  (..., A) log-probs -> (...)
======================  ===========================================  ==========================================

The clip range ``[lo, hi]`` bounds the ratio itself: PPO's symmetric ``clip_eps`` is ``[1 - eps, 1 + eps]``;
Tinker's ``loss_fn_config`` names the two bounds ``clip_low_threshold`` and ``clip_high_threshold``.
"""

from __future__ import annotations

import torch

from edurl._checks import check_same_shape

__all__ = ["clip_fraction", "clipped_surrogate", "clipped_surrogate_grad", "entropy"]


def check_clip_range(clip_low_threshold: float, clip_high_threshold: float) -> None:
    """Raise a ValueError unless ``clip_low_threshold <= 1 <= clip_high_threshold``: the range bounds the ratio
    r = pi / pi_sampler, which is 1 on-policy, and a range without 1 clips the on-policy samples of one sign of the
    advantage (with [0.2, 0.28], DAPO's eps values passed as bounds, no sample with A > 0 would ever get a gradient)."""
    if any(v != v for v in (clip_low_threshold, clip_high_threshold)):  # NaN, which every comparison calls false
        raise ValueError(
            f"the clip range must be two numbers, got [{clip_low_threshold}, {clip_high_threshold}]: a NaN bound "
            "clips nothing or everything. Pass e.g. [0.8, 1.2] for PPO's eps = 0.2."
        )
    if not clip_low_threshold <= clip_high_threshold:
        raise ValueError(
            f"the clip range needs clip_low_threshold <= clip_high_threshold, got "
            f"[{clip_low_threshold}, {clip_high_threshold}]. Both bound the ratio r = pi / pi_sampler "
            "itself, e.g. [0.8, 1.2] for PPO's eps = 0.2."
        )
    if not clip_low_threshold <= 1 <= clip_high_threshold:
        raise ValueError(
            f"the clip range [{clip_low_threshold}, {clip_high_threshold}] leaves out r = 1, the ratio of every "
            "on-policy sample, so the clip would bind for one sign of the advantage before the policy moved. The thresholds bound the ratio "
            "itself, not eps: for eps_low = 0.2 and eps_high = 0.28 pass [0.8, 1.28]."
        )


def clipped_surrogate(
    train_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low_threshold: float,
    clip_high_threshold: float,
) -> torch.Tensor:
    """PPO's per-sample (or per-token) loss: -min(r * A, clamp(r, lo, hi) * A), r = exp(lp - q).

    Gradient w.r.t. ``train_logprobs``: 0 where the clip binds (A > 0 and r > hi, or A < 0 and r < lo), else
    -r * A. On the boundary itself (r == hi or r == lo) the gradient still flows. Inside the range both terms
    of the min agree, and at r = 1 the loss is -A.
    """
    check_same_shape(train_logprobs, sampling_logprobs, "train_logprobs", "sampling_logprobs")
    check_same_shape(train_logprobs, advantages, "train_logprobs", "advantages")
    check_clip_range(clip_low_threshold, clip_high_threshold)
    ratio = torch.exp(train_logprobs - sampling_logprobs)
    return -torch.min(ratio * advantages, ratio.clamp(clip_low_threshold, clip_high_threshold) * advantages)


@torch.no_grad()
def clipped_surrogate_grad(
    train_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low_threshold: float,
    clip_high_threshold: float,
) -> torch.Tensor:
    """The gradient of :func:`clipped_surrogate` with respect to ``train_logprobs``, elementwise, in closed form:
    -r * A, and 0 where the clip binds (A > 0 and r > hi, or A < 0 and r < lo). The gradient autograd takes
    through it, boundary included (``tests/rl/test_ppo.py``); for code that backpropagates by hand
    (:meth:`edurl.rl.seed_stack.ActorCriticStack.backward_rows`)."""
    check_same_shape(train_logprobs, sampling_logprobs, "train_logprobs", "sampling_logprobs")
    check_same_shape(train_logprobs, advantages, "train_logprobs", "advantages")
    check_clip_range(clip_low_threshold, clip_high_threshold)
    ratio = torch.exp(train_logprobs - sampling_logprobs)
    binds = ((advantages > 0) & (ratio > clip_high_threshold)) | ((advantages < 0) & (ratio < clip_low_threshold))
    return torch.where(binds, 0.0, -ratio * advantages)


@torch.no_grad()
def clip_fraction(
    train_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    clip_low_threshold: float = 0.8,
    clip_high_threshold: float = 1.2,
    dim: int | None = None,
) -> torch.Tensor:
    """Share of entries (where ``mask`` is nonzero; all, if None) whose ratio r lies strictly outside
    ``[clip_low_threshold, clip_high_threshold]``: a 0-d float tensor, 0 if no entry counts (with ``dim``,
    one share per slice along the other axes: PPO's seed stack passes ``dim=-1``).

    For PPO this bounds from above the share of samples whose gradient the clip removed: an entry outside the
    range loses its gradient only when its advantage's sign makes the clip bind. Example: ratios
    [0.7, 1.0, 1.25, 1.2] with [0.8, 1.2] give 0.5 (1.2 itself is inside).
    """
    check_same_shape(train_logprobs, sampling_logprobs, "train_logprobs", "sampling_logprobs")
    check_clip_range(clip_low_threshold, clip_high_threshold)
    keep = torch.ones_like(train_logprobs, dtype=torch.bool) if mask is None else mask != 0
    if mask is not None:
        check_same_shape(train_logprobs, mask, "train_logprobs", "mask")
    ratio = torch.exp(train_logprobs - sampling_logprobs)
    outside = ((ratio < clip_low_threshold) | (ratio > clip_high_threshold)) & keep
    dtype = train_logprobs.dtype if train_logprobs.is_floating_point() else torch.get_default_dtype()
    if dim is None:
        return outside.sum().to(dtype) / keep.sum().clamp_min(1).to(dtype)
    return outside.sum(dim).to(dtype) / keep.sum(dim).clamp_min(1).to(dtype)


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy of each distribution over the last axis from its log-probs: (..., A) -> (...).

    ``-(exp(logp) * logp).sum(-1)``, with 0 log 0 = 0 for an action of probability 0 (a masked logit, -inf: the
    product was once nan, and so was its gradient); differentiable. Example: log([0.5, 0.5]) -> log 2 = 0.693 nats.
    """
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, 0.0)).sum(-1)  # masked before the product: no nan in the gradient
