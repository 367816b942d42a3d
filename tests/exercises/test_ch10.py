"""Chapter 10 checkers: pass the reference, the worked solutions and other correct ways of writing them; reject
realistic buggy versions by name."""

import math

import pytest
import torch

from edurl import exercises
from edurl.exercises import FAILED, NOT_ATTEMPTED, PASSED
from edurl.exercises.solutions import ch10
from edurl.llm import losses

from .conftest import assert_rejected

# ---------------------------------------------------------------- 10.1 truncated_importance_weights


def tis_min(lp, q, mask, cap):
    with torch.no_grad():
        return torch.minimum((lp - q).exp(), torch.full_like(lp, cap)) * mask


def tis_log_space(lp, q, mask, cap):  # min in log space, then exp: the same weights
    return ((lp.detach() - q).clamp(max=math.log(cap)).exp()) * (mask != 0)


@pytest.mark.parametrize(
    "fn", [losses.truncated_importance_weights, ch10.truncated_importance_weights, tis_min, tis_log_space]
)
def test_truncated_importance_weights_checker_passes(fn):
    verdict = exercises.check_truncated_importance_weights(fn, verbose=False)
    assert verdict.status == PASSED, verdict.message


def tis_inverted(lp, q, mask, cap):
    return (q - lp).detach().exp().clamp(max=cap) * mask


def tis_no_cap(lp, q, mask, cap):
    return (lp - q).detach().exp() * mask


def tis_both_sides(lp, q, mask, cap):
    return (lp - q).detach().exp().clamp(min=1 / cap, max=cap) * mask


def tis_ppo(lp, q, mask, cap):
    return (lp - q).detach().exp().clamp(0.8, 1.2) * mask


def tis_no_exp(lp, q, mask, cap):
    return (lp - q).detach().clamp(max=cap) * mask


def tis_cap_in_log(lp, q, mask, cap):
    return (lp - q).detach().clamp(max=cap).exp() * mask


def tis_no_mask(lp, q, mask, cap):
    return (lp - q).detach().exp().clamp(max=cap)


def tis_with_grad(lp, q, mask, cap):
    return (lp - q).exp().clamp(max=cap) * mask


def tis_per_sequence(lp, q, mask, cap):
    seq = ((lp - q) * mask).sum(-1, keepdim=True).detach().exp().clamp(max=cap)
    return seq * mask


def tis_mask_in_exp(lp, q, mask, cap):
    return ((lp - q).detach() * mask).exp().clamp(max=cap)  # exp(0) = 1 off the mask


def tis_writes_over_its_input(lp, q, mask, cap):
    x = lp.detach()  # shares lp's memory: the caller's log-probs are overwritten (this passed)
    x -= q
    return x.exp().clamp(max=cap) * mask


def tis_log_ratio_in_place(lp, q, mask, cap):
    lp -= q  # torch refuses this on a leaf; its error once reached the learner as it was
    return torch.where(mask != 0, lp.exp().clamp(max=cap), 0.0).detach()


def tis_mean_log_ratio(lp, q, mask, cap):
    mean = ((lp - q) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    return mean.detach().exp().clamp(max=cap) * mask


@pytest.mark.parametrize(
    "buggy, message",
    [
        (tis_mask_in_exp, "a log-ratio multiplied by a mask of 0 is 0, and exp(0) = 1"),
        (tis_writes_over_its_input, "changed its input `train_logprobs` in place"),
        (tis_log_ratio_in_place, "changed a tensor that needs a gradient in place (at line"),
        (tis_mean_log_ratio, "one ratio per sequence (from the sum, or the mean"),
        (tis_inverted, "the ratio is upside down"),
        (tis_no_cap, "the weights are not truncated"),
        (tis_both_sides, "clipped the ratio from below"),
        (tis_ppo, "PPO's range"),
        (tis_no_exp, "the weight is the log-ratio itself"),
        (tis_cap_in_log, "capped the log-ratio"),
        (tis_no_mask, "the prompt and padding positions got weights"),
        (tis_with_grad, "the weights carry a gradient"),
        (tis_per_sequence, "one ratio per sequence"),
    ],
)
def test_truncated_importance_weights_checker_rejects(buggy, message):
    assert_rejected(exercises.check_truncated_importance_weights, buggy, message)


def test_truncated_weights_times_reinforce_is_cispo_with_range_zero_to_cap():
    g = torch.Generator().manual_seed(0)
    q = -torch.rand(3, 7, generator=g) * 3
    lp = (q + torch.randn(3, 7, generator=g)).requires_grad_(True)
    adv, mask = torch.randn(3, 7, generator=g), torch.ones(3, 7)
    tis = -(losses.truncated_importance_weights(lp, q, mask, 2.0) * lp * adv)
    cispo = losses.cispo(lp, q, adv, clip_low_threshold=0.0, clip_high_threshold=2.0)
    assert torch.allclose(tis, cispo)
    (g1,) = torch.autograd.grad(tis.sum(), lp)
    (g2,) = torch.autograd.grad(cispo.sum(), lp)
    assert torch.allclose(g1, g2)


# ---------------------------------------------------------------- 10.2 soft_advantages


def soft_logsumexp(rewards, tau):
    return rewards - tau * (torch.logsumexp(rewards / tau, dim=1, keepdim=True) - math.log(rewards.shape[1]))


@pytest.mark.parametrize("fn", [losses.soft_advantages, ch10.soft_advantages, soft_logsumexp])
def test_soft_advantages_checker_passes(fn):
    verdict = exercises.check_soft_advantages(fn, verbose=False)
    assert verdict.status == PASSED, verdict.message


def soft_mean(r, tau):
    return r - r.mean(1, keepdim=True)


def soft_max(r, tau):
    return r - r.amax(1, keepdim=True)


def soft_lse(r, tau):
    return r - tau * torch.logsumexp(r / tau, 1, keepdim=True)


def soft_no_tau_outside(r, tau):
    m = (r / tau).amax(1, keepdim=True)
    return r - (m + ((r / tau - m).exp().mean(1, keepdim=True)).log())


def soft_batch(r, tau):
    return r - tau * (torch.logsumexp(r.reshape(-1) / tau, 0) - math.log(r.numel()))


def soft_naive(r, tau):
    return r - tau * (r / tau).exp().mean(1, keepdim=True).log()


def soft_times_tau(r, tau):
    return r - (r * tau).exp().mean(1, keepdim=True).log() / tau


def soft_batch_max_out(r, tau):
    s = r / tau
    top = s.max()  # the batch's largest, not each group's: a group far below it underflows to exp(...) = 0
    return r - tau * (top + (s - top).exp().mean(1, keepdim=True).log())


def soft_mean_out(r, tau):
    s = r / tau
    mid = s.mean(1, keepdim=True)  # each group's mean taken out: an outlier far above it still overflows
    return r - tau * (mid + (s - mid).exp().mean(1, keepdim=True).log())


def soft_in_float64(r, tau):
    return ch10.soft_advantages(r.double(), tau)  # right, but float64 for float32 rewards


@pytest.mark.parametrize(
    "buggy, message",
    [
        (soft_in_float64, "Compute in any precision you like, and end with .to(input.dtype)"),
        (lambda r, tau: r - tau * (torch.logsumexp(r / tau, 1, keepdim=True) - math.log(r.shape[1] - 1)), "G - 1"),
        (  # the number of groups for G: the worked example has one group, so it once got only the "sum" hint
            lambda r, tau: r - tau * (torch.logsumexp(r / tau, 1, keepdim=True) - math.log(r.shape[0])),
            "the number of groups, 1 here: G is rewards.shape[1]",
        ),
        (soft_mean, "you subtracted the group mean"),
        (soft_max, "you subtracted the group's maximum"),
        (soft_lse, "log of a sum"),
        (soft_no_tau_outside, "tau is missing outside the log"),
        (soft_batch, "over the whole batch"),
        (soft_naive, "overflows for a small tau"),
        (soft_times_tau, "tau is used the other way round"),
        (soft_batch_max_out, "groups whose best rewards differ"),
        (soft_mean_out, "groups whose best rewards differ"),
    ],
)
def test_soft_advantages_checker_rejects(buggy, message):
    assert_rejected(exercises.check_soft_advantages, buggy, message)


def test_unattempted_exercises_fall_back_to_the_reference():
    def todo(*args):
        raise NotImplementedError

    for check, reference in [
        (exercises.check_truncated_importance_weights, losses.truncated_importance_weights),
        (exercises.check_soft_advantages, losses.soft_advantages),
    ]:
        verdict = check(todo, verbose=False)
        assert verdict.status == NOT_ATTEMPTED and verdict.implementation is reference
    assert exercises.check_soft_advantages(soft_mean, verbose=False).status == FAILED
    assert "log mean exp" in exercises.show_solution("soft_advantages")
