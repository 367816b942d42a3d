"""Policy-gradient losses for LLMs, their aggregation, KL estimators and group advantages (Chapter 7).

Every loss takes per-token tensors of one shape, usually ``(B, T)``, and returns the per-token loss of that
shape; :func:`aggregate` then reduces it over the mask. With ``lp = logprobs`` (the policy being trained),
``q = sampling_logprobs`` (the policy that sampled the tokens), ``A = advantages`` and ``r = exp(lp - q)``:

====================  ===================================================  =========================================
name                  per-token loss                                       source
====================  ===================================================  =========================================
importance_sampling   -r * A                                               REINFORCE, corrected for off-policy samples
ppo                   -min(r * A, clamp(r, lo, hi) * A)                    Schulman et al., 2017
cispo                 -sg(clamp(r, lo, hi)) * lp * A   (sg: stop-grad)     MiniMax-M1 (MiniMax, 2025)
dro                   -(lp * A - beta / 2 * (lp - q)**2)                   Richemond et al., 2024; Kimi k1.5, 2025
====================  ===================================================  =========================================

The names and defaults follow Tinker's built-in losses, so cookbook-style loops read the same here. The
aggregation modes are those of GRPO (Shao et al., 2024), DAPO (Yu et al., 2025) and Dr. GRPO (Liu et al., 2025);
the KL estimators are from Schulman (2020), "Approximating KL Divergence".
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

from edurl._checks import check_same_shape, check_tensor

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "KL_PENALTIES",
    "LOSS_FNS",
    "aggregate",
    "cispo",
    "clip_fraction",
    "dro",
    "drop_zero_variance_groups",
    "get_loss_fn",
    "group_advantages",
    "importance_sampling",
    "kl",
    "kl_penalty_advantages",
    "loss_fn_defaults",
    "ppo",
    "zero_variance_groups",
]


def _check_inputs(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor) -> None:
    check_tensor(logprobs, "logprobs", floating=True)
    check_same_shape(logprobs, sampling_logprobs, "logprobs", "sampling_logprobs")
    check_same_shape(logprobs, advantages, "logprobs", "advantages")


def _check_thresholds(low: float, high: float) -> None:
    if not low <= high:
        raise ValueError(f"the clip range needs clip_low_threshold <= clip_high_threshold, got [{low}, {high}]. "
                         "Both bound the ratio r = pi / pi_sampler itself, e.g. [0.8, 1.2] for PPO's eps = 0.2.")


# ---------------------------------------------------------------- per-token losses


def importance_sampling(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor,
                        advantages: torch.Tensor) -> torch.Tensor:
    """-r * A, r = exp(logprobs - sampling_logprobs). Gradient w.r.t. logprobs: -r * A.

    On-policy (r = 1) this is the REINFORCE gradient; off-policy, r reweights each sampled token so the
    expected gradient is the one of the policy being trained. Nothing stops r from growing large.
    """
    _check_inputs(logprobs, sampling_logprobs, advantages)
    ratio = torch.exp(logprobs - sampling_logprobs)
    return -(ratio * advantages)


def ppo(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor,
        clip_low_threshold: float = 0.8, clip_high_threshold: float = 1.2) -> torch.Tensor:
    """-min(r * A, clamp(r, lo, hi) * A), the clipped surrogate of Chapter 5 with lo = 1 - eps, hi = 1 + eps.

    Gradient w.r.t. logprobs: 0 where the clip binds (A > 0 and r > hi, or A < 0 and r < lo), else -r * A.
    On the boundary itself (r == hi or r == lo) the gradient still flows. At r = 1 this equals
    :func:`importance_sampling`.
    """
    _check_inputs(logprobs, sampling_logprobs, advantages)
    _check_thresholds(clip_low_threshold, clip_high_threshold)
    ratio = torch.exp(logprobs - sampling_logprobs)
    clipped = ratio.clamp(clip_low_threshold, clip_high_threshold)
    return -torch.min(ratio * advantages, clipped * advantages)


def cispo(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor,
          clip_low_threshold: float = 0.0, clip_high_threshold: float = 4.0) -> torch.Tensor:
    """-sg(clamp(r, lo, hi)) * logprobs * A, sg = stop-gradient (``.detach()``).

    Gradient w.r.t. logprobs: -clamp(r, lo, hi) * A. Unlike PPO, a token whose ratio left the range keeps its
    gradient; only its importance weight is capped. So rare tokens that PPO would silence (often the "fork"
    tokens of a reasoning chain) still learn.
    """
    _check_inputs(logprobs, sampling_logprobs, advantages)
    _check_thresholds(clip_low_threshold, clip_high_threshold)
    weight = torch.exp(logprobs - sampling_logprobs).clamp(clip_low_threshold, clip_high_threshold).detach()
    return -(weight * logprobs * advantages)


def dro(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor,
        beta: float) -> torch.Tensor:
    """-(logprobs * A - beta / 2 * (logprobs - sampling_logprobs)**2).

    Gradient w.r.t. logprobs: -A + beta * (logprobs - sampling_logprobs). The quadratic penalty, not a ratio
    clip, keeps the policy near the sampler, which is what makes this loss usable off-policy and offline.
    """
    _check_inputs(logprobs, sampling_logprobs, advantages)
    if not beta >= 0:
        raise ValueError(f"dro needs beta >= 0, got {beta}. It weights the penalty beta / 2 * (lp - q)**2 that "
                         "keeps the policy near the sampler; beta = 0 drops the penalty.")
    log_ratio = logprobs - sampling_logprobs
    return -(logprobs * advantages - 0.5 * beta * log_ratio**2)


LOSS_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}


def get_loss_fn(name: str) -> Callable[..., torch.Tensor]:
    """The per-token loss called ``name`` in :data:`LOSS_FNS`."""
    if name not in LOSS_FNS:
        raise ValueError(f"unknown loss {name!r}; known losses: {', '.join(LOSS_FNS)}. "
                         "Pick one of those, or add yours to edurl.llm.losses.LOSS_FNS.")
    return LOSS_FNS[name]


def loss_fn_defaults(name: str) -> dict[str, float]:
    """The keyword defaults of the loss ``name``, e.g. ``{"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}``
    for ``"ppo"`` and ``{"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}`` for ``"cispo"``: each loss
    keeps its own, and a config field left at None means "the loss's default"."""
    params = inspect.signature(get_loss_fn(name)).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


@torch.no_grad()
def clip_fraction(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor,
                  low: float = 0.8, high: float = 1.2) -> torch.Tensor:
    """Share of masked tokens whose ratio r lies outside [low, high] (strictly); a 0-d float tensor, 0 if none.

    For PPO this bounds from above the share of tokens whose gradient the clip removed: a token outside the
    range loses its gradient only when its advantage sign makes the clip bind.
    """
    check_same_shape(logprobs, sampling_logprobs, "logprobs", "sampling_logprobs")
    check_same_shape(logprobs, mask, "logprobs", "mask")
    keep = mask != 0
    ratio = torch.exp(logprobs - sampling_logprobs)
    outside = ((ratio < low) | (ratio > high)) & keep
    return outside.sum().to(logprobs.dtype) / keep.sum().clamp_min(1).to(logprobs.dtype)


# ---------------------------------------------------------------- aggregation

AGGREGATION_MODES = ("sum", "seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")


def aggregate(per_token_loss: torch.Tensor, mask: torch.Tensor, mode: str, max_tokens: int | None = None
              ) -> torch.Tensor:
    """Reduce a (B, T) per-token loss over the tokens where ``mask`` is 1 to a scalar.

    =========================  =========================================================  ===========
    mode                       formula (L = per_token_loss, m = mask)                     used by
    =========================  =========================================================  ===========
    sum                        sum_bt m*L                                                 Tinker
    seq_mean_token_mean        mean over sequences with a token of sum_t m*L / sum_t m    GRPO
    token_mean                 sum_bt m*L / sum_bt m                                      DAPO
    seq_mean_token_sum_norm    sum_bt m*L / (B * max_tokens)                              Dr. GRPO
    =========================  =========================================================  ===========

    seq_mean_token_mean gives each sequence equal weight, so a token of a long completion counts less than a
    token of a short one (the length bias Dr. GRPO points out); token_mean gives every token equal weight, but
    its denominator still depends on the batch's lengths; seq_mean_token_sum_norm divides by the number of
    sequences times a fixed generation budget ``max_tokens`` (GRPO's ``max_tokens``), so no length bias, and a
    datum's gradient does not depend on which other datums share the call or how long their prompts are.
    ``max_tokens`` is required for that mode and ignored by the others.
    ``mask`` is bool or 0/1 float. An all-zero mask gives a 0 loss that still backpropagates (zero gradients).
    """
    check_tensor(per_token_loss, "per_token_loss", ndim=(2,), floating=True)
    check_same_shape(per_token_loss, mask, "per_token_loss", "mask")
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; known modes: {', '.join(AGGREGATION_MODES)}.")
    if mode == "seq_mean_token_sum_norm" and (max_tokens is None or not isinstance(max_tokens, int)
                                              or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ValueError(f"aggregation 'seq_mean_token_sum_norm' (Dr. GRPO) divides by number of sequences x a fixed "
                         f"generation budget, so it needs max_tokens, a positive int (got {max_tokens!r}). Pass the "
                         "sampler's max_tokens, e.g. aggregate(loss, mask, 'seq_mean_token_sum_norm', max_tokens=16).")
    keep = mask != 0  # (B, T)
    # where, not only a product, so a NaN or inf at a padding position cannot leak into the sum
    masked = torch.where(keep, per_token_loss, torch.zeros_like(per_token_loss))  # (B, T)
    tokens = keep.to(per_token_loss.dtype)  # (B, T)
    if mode == "sum":
        return masked.sum()
    if mode == "seq_mean_token_mean":
        per_seq_tokens = tokens.sum(dim=1)  # (B,)
        per_seq = masked.sum(dim=1) / per_seq_tokens.clamp_min(1)  # (B,); 0 for a sequence without tokens
        return per_seq.sum() / (per_seq_tokens > 0).sum().clamp_min(1)
    if mode == "token_mean":
        return masked.sum() / tokens.sum().clamp_min(1)
    # seq_mean_token_sum_norm: B * max_tokens, a constant: neither the lengths nor the padding change it
    return masked.sum() / (per_token_loss.shape[0] * max_tokens)


# ---------------------------------------------------------------- KL to a reference policy

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens x sampled from pi; same shape as the inputs.

    With d = ref_logprobs - logprobs = log(pi_ref(x) / pi(x)):

    ==  ==================  =====================================================================
    k1  -d                  unbiased; negative on some tokens; high variance
    k2  d**2 / 2            biased (close to the KL only when pi is near pi_ref); never negative
    k3  exp(d) - 1 - d      unbiased; never negative; low variance
    ==  ==================  =====================================================================

    All three are fine numbers to log. Used as a loss term (``loss += beta * kl(...)``, autograd
    differentiating through ``logprobs`` only, the sampled tokens held fixed), their expected gradients on
    samples from pi itself are not the same, and only one is the gradient of the KL it estimates:

    - k1: E_pi[grad k1] = E_pi[grad log pi] = sum_x grad pi(x) = 0. No pull toward pi_ref, only noise. The
      KL gradient is in the score-function term E_pi[k1 * grad log pi], which you get by subtracting
      beta * k1 from the reward (as RLHF-PPO does) instead of adding it to the loss.
    - k2: E_pi[grad k2] = E_pi[(log pi - log pi_ref) * grad log pi] = grad KL(pi || pi_ref), the
      gradient of the reverse KL that k1 and k3 estimate.
    - k3: E_pi[grad k3] = E_pi[(1 - pi_ref / pi) * grad log pi] = -sum_x pi_ref(x) grad log pi(x)
      = grad KL(pi_ref || pi), the forward KL. GRPO's k3 penalty does pull pi toward pi_ref, but as a
      mass-covering forward KL, not the reverse KL its value estimates.

    tests/llm/test_losses.py checks each of these statements on an exact categorical distribution.
    """
    check_tensor(logprobs, "logprobs", floating=True)
    check_same_shape(logprobs, ref_logprobs, "logprobs", "ref_logprobs")
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.expm1(d) - d  # expm1 keeps exp(d) - 1 accurate when pi is close to pi_ref
    raise ValueError(f"unknown KL estimator {estimator!r}; known estimators: {', '.join(KL_ESTIMATORS)}.")


KL_PENALTIES = ("reward", "loss")


def kl_penalty_advantages(advantages: torch.Tensor, sampling_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                          mask: torch.Tensor, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL penalty put into the reward (Tinker's way): per-token advantages and the mean k1 estimate.

    With k_t = sampling_logprobs - ref_logprobs = log(q / pi_ref) at every action token (mask 1) and
    kbar its mean over all action tokens of the batch::

        A'_t = A_t + kl_coef * (kbar - k_t)        on action tokens; A'_t = A_t elsewhere

    Subtracting kl_coef * k_t from every token's reward and letting the policy-gradient loss carry it gives
    E_pi[-kl_coef * k1 * grad log pi] = -kl_coef * grad KL(pi || pi_ref): the gradient of the reverse KL the
    metric reports (see :func:`kl`). Adding back the batch mean kbar is a constant baseline, so it changes the
    variance, not the expected gradient. Shapes: every argument (B, T); returns ((B, T), 0-d).
    Example: k = [0.2, 0.0, -0.1, 0.3] on four action tokens, kbar = 0.1, kl_coef = 1: the advantages move
    by [-0.1, 0.1, 0.2, -0.2].
    """
    check_tensor(advantages, "advantages", floating=True)
    for other, name in ((sampling_logprobs, "sampling_logprobs"), (ref_logprobs, "ref_logprobs"), (mask, "mask")):
        check_same_shape(advantages, other, "advantages", name)
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef!r}; 0 turns the penalty off.")
    keep = mask != 0
    k = torch.where(keep, sampling_logprobs - ref_logprobs, torch.zeros_like(advantages))  # (B, T)
    mean_k = k.sum() / keep.sum().clamp_min(1)
    return torch.where(keep, advantages + kl_coef * (mean_k - k), advantages), mean_k


# ---------------------------------------------------------------- group-relative advantages

ADVANTAGE_SCALES = ("none", "group", "batch")


def _check_rewards(rewards: torch.Tensor) -> torch.Tensor:
    check_tensor(rewards, "rewards")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be 2-D (P, G): P prompts, G samples per prompt; got shape "
                         f"{tuple(rewards.shape)}. For a single group use rewards.unsqueeze(0).")
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """(P,) bool: True where all G rewards of a group are equal, so every advantage in it is 0."""
    rewards = _check_rewards(rewards)
    return (rewards == rewards[:, :1]).all(dim=1)


def group_advantages(rewards: torch.Tensor, scale: str = "none", eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages (GRPO): A_pg = (R_pg - mean_g R_pg) / s; rewards and result (P, G).

    ========  ======================================================================================
    scale     s
    ========  ======================================================================================
    "none"    1 (Dr. GRPO: no division, so easy and hard prompts are not reweighted)
    "group"   std over the group (unbiased, torch.std's default) + eps (GRPO)
    "batch"   std over all P * G rewards + eps
    ========  ======================================================================================

    A group whose rewards are all equal gets exactly 0 everywhere (the mean need not round to the rewards'
    value, so this is set, not computed). Example: rewards [[1, .5, 0, 1]] -> [[.375, -.125, -.625, .375]].
    """
    rewards = _check_rewards(rewards)
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; known scales: {', '.join(map(repr, ADVANTAGE_SCALES))}.")
    if rewards.shape[1] < 2:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}: group-relative advantages need G >= 2 samples "
                         "per prompt (with G = 1 every advantage is 0). Sample more completions per prompt.")
    centered = rewards - rewards.mean(dim=1, keepdim=True)  # (P, G)
    centered = torch.where(zero_variance_groups(rewards)[:, None], torch.zeros_like(centered), centered)
    if scale == "group":
        return centered / (rewards.std(dim=1, keepdim=True) + eps)
    if scale == "batch":
        return centered / (rewards.std() + eps)
    return centered


def drop_zero_variance_groups(rewards: torch.Tensor, *others: torch.Tensor | Sequence
                              ) -> tuple[torch.Tensor | list, ...]:
    """DAPO's dynamic-sampling filter, without refilling: drop the groups whose rewards are all equal.

    Such a group has all-zero advantages, so it adds no gradient, only tokens to the denominator of a
    mean aggregation. ``others`` are per-group tensors (first dim P) or sequences of length P (e.g. the
    completions). Returns ``(rewards, *others)`` with only the kept groups, in the order given::

        rewards, tokens, completions = drop_zero_variance_groups(rewards, tokens, completions)

    Tensors stay tensors, sequences become lists. Use :func:`zero_variance_groups` for the mask itself,
    e.g. to log how many groups were dropped. Every group may be dropped; the results are then empty.
    """
    keep = ~zero_variance_groups(rewards)  # (P,)
    num_groups = rewards.shape[0]
    kept: list[torch.Tensor | list] = [rewards[keep]]
    for i, x in enumerate(others):
        if len(x) != num_groups:
            raise ValueError(f"others[{i}] has {len(x)} entries but rewards has {num_groups} groups; pass one "
                             "entry per group (first dimension P).")
        if isinstance(x, torch.Tensor):
            kept.append(x[keep.to(x.device)])
        else:
            kept.append([item for item, k in zip(x, keep.tolist()) if k])
    return tuple(kept)
