"""The objective of an LLM policy-gradient step, readable in one place (Chapter 7).

:func:`rl_objective` is what ``TrainingClient.forward_backward`` computes once it has the training log-probs:
a per-token loss, its aggregation over the action tokens, an optional KL term, and the diagnostics. Every
piece it calls is below it in this file. With ``lp = train_logprobs`` (the policy being trained, with
gradients), ``q = sampling_logprobs`` (the policy that sampled the tokens; the datum key ``logprobs``),
``A = advantages`` and ``r = exp(lp - q)``, the per-token losses are:

====================  ===================================================  =========================================
name                  per-token loss                                       source
====================  ===================================================  =========================================
importance_sampling   -r * A                                               REINFORCE, corrected for off-policy samples
ppo                   -min(r * A, clamp(r, lo, hi) * A)                    Schulman et al., 2017
cispo                 -sg(clamp(r, lo, hi)) * lp * A   (sg: stop-grad)     MiniMax-M1 (MiniMax, 2025)
dro                   -(lp * A - beta / 2 * (lp - q)**2)                   Richemond et al., 2024; Kimi k1.5, 2025
====================  ===================================================  =========================================

The names and defaults follow Tinker's built-in losses, so cookbook-style loops read the same here; ``lo`` and
``hi`` are Tinker's ``clip_low_threshold`` and ``clip_high_threshold``. ``ppo``'s surrogate and the clip
fraction are Chapter 5's own (:mod:`edurl.objectives`). The aggregation modes are those of GRPO (Shao et al.,
2024), DAPO (Yu et al., 2025) and Dr. GRPO (Liu et al., 2025); the KL estimators are from Schulman (2020),
"Approximating KL Divergence".
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

import torch

from edurl._checks import check_same_shape, check_tensor, is_whole
from edurl.objectives import check_clip_range, clip_fraction, clipped_surrogate

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "KL_PENALTIES",
    "LOSS_FNS",
    "aggregate",
    "check_aggregation",
    "cispo",
    "clip_bounds",
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
    "rl_objective",
    "supervised_objective",
    "zero_variance_groups",
]


# ---------------------------------------------------------------- the objective


def rl_objective(
    train_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_fn: str | Callable[..., torch.Tensor],
    loss_fn_config: dict[str, float] | None = None,
    aggregation: str = "sum",
    max_tokens: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    metric_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one RL ``forward_backward`` call, and its diagnostics. Every tensor argument is (B, T).

    ::

        per_token = loss_fn(train_logprobs, sampling_logprobs, advantages, **loss_fn_config)     # (B, T)
        loss      = aggregate(per_token, mask, aggregation, max_tokens)                          # 0-d
                  + kl_coef * aggregate(kl(train_logprobs, ref_logprobs, kl_estimator), mask, ...)

    ``loss_fn`` is a name in :data:`LOSS_FNS` or a function of that signature; a key left out of
    ``loss_fn_config`` takes the loss's own default. ``mask`` is 1 on action tokens, 0 on prompt and padding.
    The KL term (TRL's way; Tinker's puts the penalty into the advantages with :func:`kl_penalty_advantages`)
    needs ``ref_logprobs``, the reference policy's log-probs of the same tokens. Metrics, each a mean over the
    action tokens, or over ``metric_mask``'s positions when it is given (float; no gradient):

    ==============================  ============================================================================
    optim/kl_sample_train_v1        mean(q - lp): k1 estimate of KL(sampler || trainer); 0 on-policy
    optim/kl_sample_train_v2        mean((q - lp)**2) / 2: k2 estimate; never negative
    optim/clip_fraction             share of tokens with r outside the loss's clip range (:func:`clip_bounds`)
    optim/kl_ref                    k3 estimate of KL(trainer || reference); only with ``ref_logprobs``
    optim/entropy                   mean entropy of the trainer's next-token distribution; only with ``entropy``
    ==============================  ============================================================================

    On-policy (``train_logprobs`` equal to ``sampling_logprobs``) both sample-train KLs and the clip fraction
    are 0. ``forward_backward`` returns exactly this loss (tests/llm/test_clients.py checks it).
    """
    check_tensor(train_logprobs, "train_logprobs", ndim=(2,), floating=True)
    for other, name in ((sampling_logprobs, "sampling_logprobs"), (advantages, "advantages"), (mask, "mask")):
        check_same_shape(train_logprobs, other, "train_logprobs", name)
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(
            f"kl_coef={kl_coef} adds a KL penalty to the reference policy, so it needs ref_logprobs, "
            "the reference's log-probs of the same tokens (TrainingClient.compute_logprobs(datums, "
            "reference=True)); pass them, or kl_coef=0."
        )
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef!r}; 0 turns the penalty off.")
    config = dict(loss_fn_config or {})
    fn = get_loss_fn(loss_fn) if isinstance(loss_fn, str) else loss_fn
    per_token = fn(train_logprobs, sampling_logprobs, advantages, **config)  # (B, T)
    loss = aggregate(per_token, mask, aggregation, max_tokens=max_tokens)
    if metric_mask is None:
        metric_mask = mask
    check_same_shape(train_logprobs, metric_mask, "train_logprobs", "metric_mask")
    metric_mask = (metric_mask != 0).to(train_logprobs.dtype)  # as the loss counts them: every nonzero weight
    n_tok = metric_mask.sum().clamp(min=1)
    lp = train_logprobs.detach()
    diff = (sampling_logprobs - lp) * metric_mask  # (B, T) sampling - training, on action tokens
    metrics = {
        "optim/kl_sample_train_v1": float(diff.sum() / n_tok),
        "optim/kl_sample_train_v2": float(0.5 * (diff**2).sum() / n_tok),
        "optim/clip_fraction": float(clip_fraction(lp, sampling_logprobs, metric_mask, *clip_bounds(loss_fn, config))),
    }
    if ref_logprobs is not None:
        check_same_shape(train_logprobs, ref_logprobs, "train_logprobs", "ref_logprobs")
        metrics["optim/kl_ref"] = float((kl(lp, ref_logprobs, "k3") * metric_mask).sum() / n_tok)
        if kl_coef > 0:
            kl_tok = kl(train_logprobs, ref_logprobs, kl_estimator)  # (B, T), with gradients
            loss = loss + kl_coef * aggregate(kl_tok, mask, aggregation, max_tokens=max_tokens)
    if entropy is not None:
        metrics["optim/entropy"] = float((entropy * metric_mask).sum() / n_tok)
    return loss, metrics


def supervised_objective(
    train_logprobs: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: str = "sum",
    max_tokens: int | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The ``cross_entropy`` loss of ``forward_backward`` (SFT): ``aggregate(-train_logprobs * weights, mask,
    aggregation)``, and ``optim/entropy`` when ``entropy`` is given. Every tensor argument is (B, T)."""
    check_tensor(train_logprobs, "train_logprobs", ndim=(2,), floating=True)
    check_same_shape(train_logprobs, weights, "train_logprobs", "weights")
    loss = aggregate(-train_logprobs * weights, mask, aggregation, max_tokens=max_tokens)
    metrics = {}
    if entropy is not None:
        metrics["optim/entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
    return loss, metrics


def _check_inputs(train_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor) -> None:
    check_tensor(train_logprobs, "train_logprobs", floating=True)
    check_same_shape(train_logprobs, sampling_logprobs, "train_logprobs", "sampling_logprobs")
    check_same_shape(train_logprobs, advantages, "train_logprobs", "advantages")


# ---------------------------------------------------------------- per-token losses


def importance_sampling(
    train_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """-r * A, r = exp(train_logprobs - sampling_logprobs). Gradient w.r.t. train_logprobs: -r * A.

    On-policy (r = 1) this is the REINFORCE gradient; off-policy, r reweights each sampled token so the
    expected gradient is the one of the policy being trained. Nothing stops r from growing large.
    """
    _check_inputs(train_logprobs, sampling_logprobs, advantages)
    ratio = torch.exp(_on_policy_at_zero_advantage(train_logprobs, sampling_logprobs, advantages) - sampling_logprobs)
    return -(ratio * advantages)


def _on_policy_at_zero_advantage(
    train_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """``train_logprobs`` with the sampler's log-probs where the advantage is 0 (no gradient flows there). The
    loss there is 0 either way, but a ratio that overflows (a log-ratio past about 88 in float32) would make it
    inf * 0 = NaN, in the value and the gradient: so a datum whose advantages are all 0 adds exactly nothing,
    as :data:`ZERO_AT_ZERO_ADVANTAGE` promises, and skipping it gives the same update as scoring it."""
    return torch.where(advantages == 0, sampling_logprobs, train_logprobs)


def ppo(
    train_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low_threshold: float = 0.8,
    clip_high_threshold: float = 1.2,
) -> torch.Tensor:
    """-min(r * A, clamp(r, lo, hi) * A): Chapter 5's :func:`edurl.objectives.clipped_surrogate`, per token.

    Gradient w.r.t. train_logprobs: 0 where the clip binds (A > 0 and r > hi, or A < 0 and r < lo), else -r * A.
    On the boundary itself (r == hi or r == lo) the gradient still flows. At r = 1 this equals
    :func:`importance_sampling`. PPO's eps = 0.2 is the range [0.8, 1.2].
    """
    _check_inputs(train_logprobs, sampling_logprobs, advantages)
    train_logprobs = _on_policy_at_zero_advantage(train_logprobs, sampling_logprobs, advantages)
    return clipped_surrogate(train_logprobs, sampling_logprobs, advantages, clip_low_threshold, clip_high_threshold)


def cispo(
    train_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low_threshold: float = 0.0,
    clip_high_threshold: float = 4.0,
) -> torch.Tensor:
    """-sg(clamp(r, lo, hi)) * train_logprobs * A, sg = stop-gradient (``.detach()``).

    Gradient w.r.t. train_logprobs: -clamp(r, lo, hi) * A. Unlike PPO, a token whose ratio left the range keeps
    its gradient; only its importance weight is capped. So rare tokens that PPO would silence (often the "fork"
    tokens of a reasoning chain) still learn.
    """
    _check_inputs(train_logprobs, sampling_logprobs, advantages)
    check_clip_range(clip_low_threshold, clip_high_threshold)
    weight = torch.exp(train_logprobs - sampling_logprobs).clamp(clip_low_threshold, clip_high_threshold).detach()
    return -(weight * train_logprobs * advantages)


def dro(
    train_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor, beta: float
) -> torch.Tensor:
    """-(train_logprobs * A - beta / 2 * (train_logprobs - sampling_logprobs)**2).

    Gradient w.r.t. train_logprobs: -A + beta * (train_logprobs - sampling_logprobs). The quadratic penalty,
    not a ratio clip, keeps the policy near the sampler, which is what makes this loss usable off-policy and
    offline.
    """
    _check_inputs(train_logprobs, sampling_logprobs, advantages)
    if not beta >= 0:
        raise ValueError(
            f"dro needs beta >= 0, got {beta}. It weights the penalty beta / 2 * (lp - q)**2 that "
            "keeps the policy near the sampler; beta = 0 drops the penalty."
        )
    log_ratio = train_logprobs - sampling_logprobs
    return -(train_logprobs * advantages - 0.5 * beta * log_ratio**2)


def truncated_importance_weights(
    train_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Per-token ``min(r, cap)``, r = exp(train_logprobs - sampling_logprobs), on the action tokens (0 where
    ``mask`` is 0), without gradient: truncated importance sampling (TIS; Yao et al., 2025), the weight that
    corrects a stale or mismatched sampler's tokens while capping what one rare token can do. All (B, T).

    ``-(weights * train_logprobs * A)`` is then a REINFORCE loss for the off-policy batch; it is :func:`cispo`
    with the range [0, cap]. Example: log-ratios [0, log 3, -log 2] with cap 2 -> [1, 2, 0.5].
    """
    _check_inputs(train_logprobs, sampling_logprobs, train_logprobs)
    check_same_shape(train_logprobs, mask, "train_logprobs", "mask")
    if not cap > 0:
        raise ValueError(f"cap must be > 0 (TIS uses about 2), got {cap!r}")
    ratio = torch.exp((train_logprobs - sampling_logprobs).detach())
    return torch.where(mask != 0, ratio.clamp(max=cap), torch.zeros_like(ratio))


LOSS_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}


ZERO_AT_ZERO_ADVANTAGE = frozenset({"importance_sampling", "ppo", "cispo"})
"""The losses in :data:`LOSS_FNS` whose per-token value and gradient are exactly 0 wherever the advantage is 0,
whatever the ratio, even one that overflows to inf. A datum whose advantages are all 0 then adds nothing to the
gradient, only tokens to the aggregation's denominator, so ``TrainingClient.forward_backward`` runs no backward pass
through it. Not ``dro``: its penalty ``beta / 2 * (lp - q)**2`` has a gradient at A = 0."""


def get_loss_fn(name: str) -> Callable[..., torch.Tensor]:
    """The per-token loss called ``name`` in :data:`LOSS_FNS`."""
    if name not in LOSS_FNS:
        raise ValueError(
            f"unknown loss {name!r}; known losses: {', '.join(LOSS_FNS)}. "
            "Pick one of those, or add yours to edurl.llm.losses.LOSS_FNS."
        )
    return LOSS_FNS[name]


def loss_fn_defaults(name: str) -> dict[str, float]:
    """The keyword defaults of the loss ``name``, e.g. ``{"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}``
    for ``"ppo"`` and ``{"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}`` for ``"cispo"``: each loss
    keeps its own, and a config field left at None means "the loss's default"."""
    params = inspect.signature(get_loss_fn(name)).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def clip_bounds(
    loss_fn: str | Callable[..., torch.Tensor], loss_fn_config: dict[str, float] | None = None
) -> tuple[float, float]:
    """The ratio range ``(clip_low_threshold, clip_high_threshold)`` that ``optim/clip_fraction`` counts
    against: the loss's own clip for ``ppo`` and ``cispo`` (``loss_fn_config`` over its defaults), else PPO's
    [0.8, 1.2], a yardstick of how far the trainer has moved from the sampler."""
    bounds = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    if loss_fn in ("ppo", "cispo"):
        bounds.update(loss_fn_defaults(loss_fn))
        bounds.update({k: v for k, v in (loss_fn_config or {}).items() if k in bounds})
    return bounds["clip_low_threshold"], bounds["clip_high_threshold"]


# ---------------------------------------------------------------- aggregation

AGGREGATION_MODES = ("sum", "seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")


def check_aggregation(mode: str, max_tokens: int | None = None) -> None:
    """Refuse an unknown aggregation ``mode``, and Dr. GRPO's without its generation budget ``max_tokens``."""
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; known modes: {', '.join(AGGREGATION_MODES)}.")
    if mode == "seq_mean_token_sum_norm" and (not is_whole(max_tokens) or max_tokens < 1):
        raise ValueError(
            f"aggregation 'seq_mean_token_sum_norm' (Dr. GRPO) divides by number of sequences x a fixed "
            f"generation budget, so it needs max_tokens, a positive int (got {max_tokens!r}). Pass the "
            "sampler's max_tokens, e.g. aggregate(loss, mask, 'seq_mean_token_sum_norm', max_tokens=16)."
        )


def aggregate(
    per_token_loss: torch.Tensor, mask: torch.Tensor, mode: str, max_tokens: int | None = None
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
    datum's gradient depends on how many datums share the call, not on how long they or their prompts are.
    ``max_tokens`` is required for that mode and ignored by the others.
    ``mask`` is bool or float, and every nonzero entry counts whole (0.5 as well as 1; :func:`rl_objective`'s
    metrics count them the same way). An all-zero mask gives a 0 loss that still backpropagates (zero gradients).
    """
    check_tensor(per_token_loss, "per_token_loss", ndim=(2,), floating=True)
    check_same_shape(per_token_loss, mask, "per_token_loss", "mask")
    check_aggregation(mode, max_tokens)
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


def kl(train_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens x sampled from pi; same shape as the inputs.

    With d = ref_logprobs - train_logprobs = log(pi_ref(x) / pi(x)):

    ==  ==================  =====================================================================
    k1  -d                  unbiased; negative on some tokens; high variance
    k2  d**2 / 2            biased (close to the KL only when pi is near pi_ref); never negative
    k3  exp(d) - 1 - d      unbiased; never negative; low variance
    ==  ==================  =====================================================================

    All three are fine numbers to log. Used as a loss term (``loss += beta * kl(...)``, autograd
    differentiating through ``train_logprobs`` only, the sampled tokens held fixed), their expected gradients on
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
    check_tensor(train_logprobs, "train_logprobs", floating=True)
    check_same_shape(train_logprobs, ref_logprobs, "train_logprobs", "ref_logprobs")
    d = ref_logprobs - train_logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.expm1(d) - d  # expm1 keeps exp(d) - 1 accurate when pi is close to pi_ref
    raise ValueError(f"unknown KL estimator {estimator!r}; known estimators: {', '.join(KL_ESTIMATORS)}.")


KL_PENALTIES = ("reward", "loss")


def kl_penalty_advantages(
    advantages: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
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
        raise ValueError(
            f"rewards must be 2-D (P, G): P prompts, G samples per prompt; got shape "
            f"{tuple(rewards.shape)}. For a single group use rewards.unsqueeze(0)."
        )
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
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)}: group-relative advantages need G >= 2 samples "
            "per prompt (with G = 1 every advantage is 0). Sample more completions per prompt."
        )
    centered = rewards - rewards.mean(dim=1, keepdim=True)  # (P, G)
    centered = torch.where(zero_variance_groups(rewards)[:, None], torch.zeros_like(centered), centered)
    if scale == "group":
        return centered / (rewards.std(dim=1, keepdim=True) + eps)
    if scale == "batch":
        return centered / (rewards.std() + eps)
    return centered


def soft_advantages(rewards: torch.Tensor, tau: float) -> torch.Tensor:
    """DRO's soft advantages (Richemond et al., 2024; Kimi k1.5): A_pg = R_pg - tau * log mean_g exp(R_pg / tau);
    rewards and result (P, G).

    The baseline ``tau * log mean exp(R / tau)`` is a soft maximum of the group's rewards: the value of a policy
    that reweights the group by ``exp(R / tau)``, which is what the regularised objective's optimum does. As
    tau -> infinity it tends to the group mean (GRPO's advantage); as tau -> 0 to the group's maximum, so only the
    best samples keep advantage 0 and every other one is pushed down. ``tau = 0`` gives that limit. DRO's loss
    (:func:`dro`) uses tau = its ``beta``. Example: rewards [[1, 0]], tau 1 -> baseline log((e + 1) / 2) = 0.620,
    advantages [[0.380, -0.620]]. A group whose rewards are all equal gets 0 everywhere.
    """
    rewards = _check_rewards(rewards)
    if not tau >= 0 or not math.isfinite(tau):
        raise ValueError(f"tau must be a finite number >= 0 (DRO's beta; 0 is the max), got {tau!r}")
    r = rewards.double()  # float64: for a large tau the baseline is the mean plus a small correction
    top = r.max(dim=1, keepdim=True).values  # (P, 1)
    if tau == 0:
        baseline = top
    else:  # top + tau * log mean exp((R - top) / tau): no overflow for a small tau, and as log1p of a mean of
        # expm1, no rounding of exp(tiny) to 1 for a large one (which gave the max's baseline from tau ~ 1e15)
        baseline = top + tau * torch.log1p(torch.expm1((r - top) / tau).mean(dim=1, keepdim=True))
    advantages = (r - baseline).to(rewards.dtype)
    return torch.where(zero_variance_groups(rewards)[:, None], torch.zeros_like(advantages), advantages)


def drop_zero_variance_groups(
    rewards: torch.Tensor, *others: torch.Tensor | Sequence
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
            raise ValueError(
                f"others[{i}] has {len(x)} entries but rewards has {num_groups} groups; pass one "
                "entry per group (first dimension P)."
            )
        if isinstance(x, torch.Tensor):
            kept.append(x[keep.to(x.device)])
        else:
            kept.append([item for item, k in zip(x, keep.tolist()) if k])
    return tuple(kept)
