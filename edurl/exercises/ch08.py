"""Checkers for Chapter 8's exercises: the reward model's Bradley-Terry loss (8.1), DPO's loss (8.2) and the
KL-shaped RLHF reward (8.3). Each compares the learner's function with the library's reference in
``edurl.llm.preference``: the two losses by their values and their gradients, the shaped reward by its values."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from edurl.exercises._core import (
    Case,
    Diagnosis,
    Hints,
    Verdict,
    compare_outputs,
    compare_tensors,
    run_checker,
    with_hints,
)
from edurl.exercises._grad import with_gradients
from edurl.exercises.solutions import ch08 as _solutions
from edurl.llm.preference import bradley_terry_loss as _library_bt
from edurl.llm.preference import dpo_loss as _library_dpo
from edurl.llm.preference import kl_shaped_rewards as _library_kl

__all__ = ["check_bradley_terry_loss", "check_dpo_loss", "check_kl_shaped_rewards"]


# ================================================================ mistakes shared by the two losses
# A Bradley-Terry loss is a function of the margin r_c - r_r, and DPO's is the same function of the implicit
# rewards' margin; so each mistake below is written once, for (chosen, rejected) rewards, and reused for DPO.


def _swapped(chosen, rejected):
    return _library_bt(rejected, chosen)


def _summed(chosen, rejected):
    return _library_bt(chosen, rejected) * chosen.numel()


_EPSILONS = (1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10, 1e-12)

#: -log sigmoid(x) written the ways that overflow: each is right for moderate margins, inf or NaN at x = -100 (or,
#: for the last two, wrong at x = -1000)
_NAIVE_NEG_LOG_SIGMOID = (
    lambda x: -torch.log(torch.sigmoid(x)),
    lambda x: torch.log(1 + torch.exp(-x)),
    lambda x: -torch.log(1 / (1 + torch.exp(-x))),
    lambda x: -torch.log(torch.exp(x) / (1 + torch.exp(x))),
    # finite, but capped at -log(eps): 18.4 per pair for 1e-8 (the epsilons learners reach for, added or clamped)
    *(lambda x, eps=eps: -torch.log(torch.sigmoid(x) + eps) for eps in _EPSILONS),
    *(lambda x, eps=eps: -torch.log(torch.sigmoid(x).clamp(min=eps)) for eps in _EPSILONS),
    lambda x: -torch.log(torch.sigmoid(x.double())).to(x.dtype),  # float64 only moves the overflow to x = -709.8
    lambda x: -F.logsigmoid(x.clamp(-100, 100)),  # the clamp caps the loss, and its gradient is 0 past it
)


def _naive(neg_log_sigmoid):
    return lambda chosen, rejected: neg_log_sigmoid(chosen - rejected).mean()


_SWAPPED_HINT = (
    "chosen and rejected are swapped: the loss must fall as the chosen reply's reward rises above the rejected "
    "one's, so the margin is chosen minus rejected."
)
_SUM_HINT = "you took the sum over pairs; take the mean over pairs, so the loss does not grow with the batch size."
_UNSTABLE_HINT = (
    "the loss is not numerically stable: sigmoid(-100) rounds to 0 in float32 and its log to -inf (an epsilon "
    "inside the log, or a clamp on the margin, only caps the loss instead; float64 only moves the overflow to a "
    "margin of -709.8). Use torch.nn.functional.logsigmoid, which computes log(sigmoid(x)) "
    "without forming sigmoid(x), so it stays finite at any margin."
)


def _kinked_at_zero(relu):
    """-log sigmoid(x) = max(-x, 0) + log(1 + exp(-|x|)), right everywhere, but with max(-x, 0) written as a clamp
    or a relu, whose derivative at x = 0 torch takes from one side (-1 or 0; the true one is -1/2)."""
    return lambda c, r: ((relu(r - c)) + torch.log1p(torch.exp(-(c - r).abs()))).mean()


_KINK_HINT = (
    "the loss is right, but its gradient at a margin of exactly 0 is not: max(-x, 0) written with clamp or relu "
    "takes its derivative at 0 from one side, and -log sigmoid(x) has slope -1/2 there. Use "
    "torch.nn.functional.logsigmoid (or torch.maximum, which splits the tie)."
)


def _shared_diagnoses(swapped_hint: str, on_rewards=lambda buggy: buggy) -> list[Diagnosis]:
    """The mistakes both losses share, turned into the exercise's signature by ``on_rewards``."""
    return [
        Diagnosis(on_rewards(_swapped), swapped_hint),
        Diagnosis(on_rewards(_summed), _SUM_HINT),
        *(Diagnosis(on_rewards(_naive(f)), _UNSTABLE_HINT) for f in _NAIVE_NEG_LOG_SIGMOID),
        *(Diagnosis(on_rewards(_kinked_at_zero(relu)), _KINK_HINT) for relu in (lambda x: x.clamp(min=0), torch.relu)),
    ]


# ================================================================ 8.1 bradley_terry_loss


def _sigmoid_no_log(chosen_rewards, rejected_rewards):
    return (1 - torch.sigmoid(chosen_rewards - rejected_rewards)).mean()


def _minus_sigmoid(chosen_rewards, rejected_rewards):
    return -torch.sigmoid(chosen_rewards - rejected_rewards).mean()


def _log_of_difference(chosen_rewards, rejected_rewards):
    return -torch.log(chosen_rewards - rejected_rewards).mean()


def _chosen_detached(chosen_rewards, rejected_rewards):
    return _library_bt(chosen_rewards.detach(), rejected_rewards)


def _rejected_detached(chosen_rewards, rejected_rewards):
    return _library_bt(chosen_rewards, rejected_rewards.detach())


_NO_LOG_HINT = (
    "the loss uses the sigmoid without the log. Bradley-Terry's sigmoid(r_c - r_r) is the probability of the "
    "label; the loss is its negative log-likelihood, whose gradient does not vanish when the model is badly wrong."
)
_DETACHED_HINT = (
    "the gradient does not reach one of the rewards: it was detached (.detach(), .item(), torch.no_grad() or a "
    "NumPy round trip). The reward model learns from both replies of a pair: pushing the chosen one up and the "
    "rejected one down."
)

_BT_DIAGNOSES = [
    *_shared_diagnoses(_SWAPPED_HINT),
    Diagnosis(_sigmoid_no_log, _NO_LOG_HINT),
    Diagnosis(_minus_sigmoid, _NO_LOG_HINT),
    Diagnosis(
        _log_of_difference,
        "you took the log of the reward difference itself, which is -inf at equal rewards and NaN when the "
        "rejected reply scores higher. The difference goes through the sigmoid first: log of a probability.",
    ),
    Diagnosis(_chosen_detached, _DETACHED_HINT),
    Diagnosis(_rejected_detached, _DETACHED_HINT),
]


def _bt_cases() -> list[Case]:
    g = torch.Generator().manual_seed(81)
    equal = torch.tensor([0.5, -1.0, 2.0])
    return [
        Case(
            "equal rewards: every pair's loss is log 2 = 0.6931",
            dict(chosen_rewards=equal.clone(), rejected_rewards=equal.clone()),
        ),
        # sigmoid(log 3) = 3/4, so -log(3/4) = 0.2877
        Case(
            "one pair (B = 1), margin log 3: loss -log(3/4) = 0.2877",
            dict(chosen_rewards=torch.tensor([math.log(3) + 1.0]), rejected_rewards=torch.tensor([1.0])),
        ),
        Case(
            "8 pairs, random rewards",
            dict(chosen_rewards=torch.randn(8, generator=g) * 2, rejected_rewards=torch.randn(8, generator=g) * 2),
        ),
        Case(
            "large margins ±50, ±100 and ±1000: a confident reward model, right and wrong",
            dict(
                chosen_rewards=torch.tensor([60.0, 10.0, 100.0, 0.0, 1000.0, 0.0]),
                rejected_rewards=torch.tensor([10.0, 60.0, 0.0, 100.0, 0.0, 1000.0]),
            ),
        ),
        Case(
            "32 pairs in float64",
            dict(
                chosen_rewards=torch.randn(32, generator=g, dtype=torch.float64) * 3 + 1,
                rejected_rewards=torch.randn(32, generator=g, dtype=torch.float64) * 3,
            ),
        ),
    ]


_HINTS_BT = Hints(
    idea=(
        "The reward model should score the reply people chose above the one they rejected. Bradley-Terry turns the "
        "gap between the two scores into the probability that the chosen reply wins; the loss says how unlikely "
        "the observed labels are under that model, averaged over pairs, computed so that it stays finite for any gap."
    ),
    formula="loss = mean over pairs of -log sigmoid(r_c - r_r), with log sigmoid computed by "
    "torch.nn.functional.logsigmoid (never log(sigmoid(x)), which overflows for large gaps).",
    solution=_solutions.bradley_terry_loss,
)


@with_hints(_HINTS_BT)
def check_bradley_terry_loss(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``bradley_terry_loss(chosen_rewards, rejected_rewards)``: (B,) and (B,) -> a scalar; its
    value and its gradients with respect to both inputs."""
    return run_checker(
        "Exercise 8.1 bradley_terry_loss",
        fn,
        _library_bt,
        _bt_cases(),
        diagnoses=_BT_DIAGNOSES,
        wrap=with_gradients(["loss"], [("loss", 0), ("loss", 1)]),
        compare=compare_outputs(
            ["loss", "d loss / d chosen_rewards", "d loss / d rejected_rewards"], rtol=1e-4, atol=1e-6
        ),
        verbose=verbose,
        hints=_HINTS_BT,
    )


# ================================================================ 8.2 dpo_loss


def _on_implicit_rewards(bt):
    """A DPO loss from a (buggy) Bradley-Terry loss: the same mistake, on the implicit rewards beta * log(pi / ref)."""

    def dpo(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
        return bt(beta * (policy_chosen_logps - ref_chosen_logps), beta * (policy_rejected_logps - ref_rejected_logps))

    return dpo


def _no_reference(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
    zeros = torch.zeros_like(ref_chosen_logps)
    return _library_dpo(policy_chosen_logps, policy_rejected_logps, zeros, zeros, beta)


def _reference_added(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
    return _library_dpo(policy_chosen_logps, policy_rejected_logps, -ref_chosen_logps, -ref_rejected_logps, beta)


def _beta_outside(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
    return beta * _library_dpo(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, 1.0)


def _divided_by_beta(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
    return _library_dpo(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, 1 / beta)


def _no_beta(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
    return _library_dpo(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, 1.0)


_DPO_DIAGNOSES = [
    *_shared_diagnoses(
        "chosen and rejected are swapped, or the log-ratios are upside down (log ref - log pi): the loss must fall "
        "as the policy raises the chosen reply's probability relative to the reference, and lowers the rejected's.",
        _on_implicit_rewards,
    ),
    Diagnosis(
        _no_reference,
        "the loss ignores the reference model: it compares the policy's log-probs of the two replies directly. "
        "DPO's implicit reward of a reply is beta times the log-ratio of the policy to the reference, so each "
        "reply's reference log-prob is subtracted from the policy's.",
    ),
    Diagnosis(
        _reference_added,
        "the reference log-probs enter with the wrong sign (added to the policy's, or paired with the other "
        "reply): each reply's implicit reward is its policy log-prob minus its own reference log-prob.",
    ),
    Diagnosis(
        _beta_outside,
        "beta multiplies the loss instead of the margin: it belongs inside the log-sigmoid, scaling the difference "
        "of log-ratios, where it sets how hard the policy is tied to the reference.",
    ),
    Diagnosis(
        _divided_by_beta,
        "you divided the margin by beta; multiply it by beta (inside the log-sigmoid). With beta = 0.1 a division "
        "makes the margins 100 times too large.",
    ),
    Diagnosis(_no_beta, "beta is missing: the margin of log-ratios is scaled by beta inside the log-sigmoid."),
]


def _dpo_case(name: str, g: torch.Generator, n: int, beta: float, drift: float, dtype=torch.float32) -> Case:
    """``n`` pairs of summed sequence log-probs: the reference's between -45 and -5, the policy's ``drift`` away."""
    ref_chosen, ref_rejected = (-torch.rand(n, generator=g, dtype=dtype) * 40 - 5 for _ in range(2))
    return Case(
        name,
        dict(
            policy_chosen_logps=ref_chosen + torch.randn(n, generator=g, dtype=dtype) * drift,
            policy_rejected_logps=ref_rejected + torch.randn(n, generator=g, dtype=dtype) * drift,
            ref_chosen_logps=ref_chosen,
            ref_rejected_logps=ref_rejected,
            beta=beta,
        ),
    )


def _dpo_cases() -> list[Case]:
    g = torch.Generator().manual_seed(82)
    chosen, rejected = torch.tensor([-12.5, -30.25, -8.0]), torch.tensor([-15.0, -22.5, -9.125])
    return [
        Case(
            "policy = reference: the loss is log 2 = 0.6931 whatever beta (beta = 0.1)",
            dict(
                policy_chosen_logps=chosen.clone(),
                policy_rejected_logps=rejected.clone(),
                ref_chosen_logps=chosen,
                ref_rejected_logps=rejected,
                beta=0.1,
            ),
        ),
        # beta * ((pi_c - ref_c) - (pi_r - ref_r)) = 0.5 * ((-1 + 3) - (-4 + 2)) = 2, and -log sigmoid(2) = 0.1269
        Case(
            "one pair by hand (B = 1), beta = 0.5: margin 0.5 * 4 = 2, loss 0.1269",
            dict(
                policy_chosen_logps=torch.tensor([-1.0]),
                policy_rejected_logps=torch.tensor([-4.0]),
                ref_chosen_logps=torch.tensor([-3.0]),
                ref_rejected_logps=torch.tensor([-2.0]),
                beta=0.5,
            ),
        ),
        _dpo_case("8 pairs of summed log-probs, beta = 0.1", g, 8, beta=0.1, drift=3.0),
        _dpo_case("16 pairs in float64, beta = 0.5", g, 16, beta=0.5, drift=2.0, dtype=torch.float64),
        # margins of hundreds of nats, as DPO reaches on long replies once it pushes the rejected ones far down, and
        # one of about 2000, where a float64 log(sigmoid) overflows too (8.1's case at -1000 catches it there)
        Case(
            "a policy far from its reference, beta = 0.5: beta * margin = +100, -110 and -995",
            dict(
                policy_chosen_logps=torch.tensor([-20.0, -230.0, -2000.0]),
                policy_rejected_logps=torch.tensor([-230.0, -20.0, -20.0]),
                ref_chosen_logps=torch.tensor([-25.0, -25.0, -25.0]),
                ref_rejected_logps=torch.tensor([-35.0, -35.0, -35.0]),
                beta=0.5,
            ),
        ),
    ]


_HINTS_DPO = Hints(
    idea=(
        "DPO needs no separate reward model: it scores each reply by how much more likely the policy makes it than "
        "the frozen reference does, scaled by beta, and applies the Bradley-Terry loss of exercise 8.1 to those "
        "implicit rewards. Only the policy's log-probs get a gradient; the reference's are constants."
    ),
    formula="margin = (pi_c - ref_c) - (pi_r - ref_r), each term a summed sequence log-prob; "
    "loss = mean over pairs of -logsigmoid(beta * margin).",
    solution=_solutions.dpo_loss,
)


@with_hints(_HINTS_DPO)
def check_dpo_loss(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps,
    ref_rejected_logps, beta)``: four (B,) summed log-probs -> a scalar; its value and its gradients with respect
    to the policy's log-probs (the reference's are constants without gradient)."""
    return run_checker(
        "Exercise 8.2 dpo_loss",
        fn,
        _library_dpo,
        _dpo_cases(),
        diagnoses=_DPO_DIAGNOSES,
        wrap=with_gradients(["loss"], [("loss", 0), ("loss", 1)]),
        compare=compare_outputs(
            ["loss", "d loss / d policy_chosen_logps", "d loss / d policy_rejected_logps"], rtol=1e-4, atol=1e-6
        ),
        verbose=verbose,
        hints=_HINTS_DPO,
    )


# ================================================================ 8.3 kl_shaped_rewards


def _masked_log_ratio(logprobs, ref_logprobs, mask):
    return torch.where(mask != 0, logprobs - ref_logprobs, torch.zeros_like(logprobs))  # (B, T)


def _unmasked(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return _library_kl(rewards, logprobs, ref_logprobs, torch.ones_like(mask), kl_coef)


def _penalty_added(rewards, logprobs, ref_logprobs, mask, kl_coef):
    # the same function as the log-ratio reversed, rewards - kl_coef * sum(mask * (ref_logprobs - logprobs))
    return rewards + kl_coef * _masked_log_ratio(logprobs, ref_logprobs, mask).sum(dim=1)


def _mean_over_reply(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return rewards - kl_coef * _masked_log_ratio(logprobs, ref_logprobs, mask).sum(dim=1) / (mask != 0).sum(dim=1)


def _mean_over_positions(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return rewards - kl_coef * _masked_log_ratio(logprobs, ref_logprobs, mask).mean(dim=1)


def _coef_on_reward(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return kl_coef * rewards - _masked_log_ratio(logprobs, ref_logprobs, mask).sum(dim=1)


def _coef_on_both(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return kl_coef * (rewards - _masked_log_ratio(logprobs, ref_logprobs, mask).sum(dim=1))


def _per_token(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return rewards[:, None] - kl_coef * _masked_log_ratio(logprobs, ref_logprobs, mask)


_MEAN_HINT = (
    "you averaged the log-ratio over tokens; sum it over the reply's tokens. The KL of a whole reply is the sum of "
    "its tokens' log-ratios, so a longer reply that drifts as far per token pays more."
)
_COEF_HINT = (
    "kl_coef scales the reward model's score; it should weight only the KL penalty, and leave the score as it is."
)

_KL_DIAGNOSES = [
    Diagnosis(
        _unmasked,
        "the mask is ignored: the prompt's and the padding's positions are counted in the KL. Only the reply's "
        "tokens were sampled by the policy; add up the log-ratios where mask is 1 only.",
    ),
    Diagnosis(
        _penalty_added,
        "the KL penalty has the wrong sign: you added it, or took the log-ratio upside down (log ref - log pi). "
        "The penalty is kl_coef times log pi - log ref, subtracted from the reward, so drifting away from the "
        "reference costs reward.",
    ),
    Diagnosis(_mean_over_reply, _MEAN_HINT),
    Diagnosis(_mean_over_positions, _MEAN_HINT),
    Diagnosis(_coef_on_reward, _COEF_HINT),
    Diagnosis(_coef_on_both, _COEF_HINT),
    Diagnosis(
        _per_token,
        "you returned one value per token. This exercise asks for one shaped reward per reply: sum the penalty over "
        "the reply's tokens.",
    ),
]


def _mask(lengths: list[tuple[int, int]], T: int, dtype) -> torch.Tensor:
    """A (B, T) mask with 1 on each row's reply, given as (prompt length, reply length): 0 on prompt and padding."""
    mask = torch.zeros(len(lengths), T, dtype=dtype)
    for row, (start, length) in enumerate(lengths):
        mask[row, start : start + length] = 1
    return mask


def _kl_case(name: str, g, lengths, T: int, kl_coef: float, mask_dtype=torch.float32, dtype=torch.float32) -> Case:
    """Random per-token log-probs: the masked positions hold nonzero log-ratios too, so counting them shows."""
    B = len(lengths)
    ref_logprobs = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    return Case(
        name,
        dict(
            rewards=torch.randn(B, generator=g, dtype=dtype),
            logprobs=ref_logprobs + torch.randn(B, T, generator=g, dtype=dtype) * 0.5,
            ref_logprobs=ref_logprobs,
            mask=_mask(lengths, T, mask_dtype),
            kl_coef=kl_coef,
        ),
    )


def _kl_cases() -> list[Case]:
    g = torch.Generator().manual_seed(83)
    return [
        # log-ratios [0.3 | 0.5, 0.25 | 0.7]: prompt | reply | padding, so 1 - 0.4 * (0.5 + 0.25) = 0.7
        Case(
            "worked example: reward 1, reply log-ratios 0.5 and 0.25, kl_coef 0.4 -> 0.7 (prompt and padding masked)",
            dict(
                rewards=torch.tensor([1.0]),
                logprobs=torch.tensor([[-1.25, -0.5, -2.0, -0.125]]),
                ref_logprobs=torch.tensor([[-1.55, -1.0, -2.25, -0.825]]),
                mask=torch.tensor([[0.0, 1.0, 1.0, 0.0]]),
                kl_coef=0.4,
            ),
        ),
        _kl_case(
            "3 replies with prompts and padding of different lengths, 0./1. float mask",
            g,
            [(2, 3), (4, 4), (1, 6)],
            8,
            0.1,
        ),
        _kl_case(
            "8 replies x 16 positions, bool mask, kl_coef 0.05",
            g,
            [(3, 5), (3, 13), (6, 2), (2, 14), (5, 11), (3, 8), (4, 1), (8, 8)],
            16,
            0.05,
            mask_dtype=torch.bool,
        ),
        _kl_case("kl_coef = 0: the rewards come back unchanged", g, [(2, 3), (3, 2)], 6, 0.0),
        _kl_case(
            "float64, kl_coef 0.2, the last reply has no tokens (its mask is all 0)",
            g,
            [(2, 5), (1, 8), (4, 3), (3, 0)],
            10,
            0.2,
            dtype=torch.float64,
            mask_dtype=torch.float64,
        ),
    ]


_HINTS_KL = Hints(
    idea=(
        "The shaped reward is the reward model's score minus a penalty for drifting away from the reference policy. "
        "A reply's drift is estimated from its own sampled tokens: how much more likely the policy made each of them "
        "than the reference did, added up over the reply's tokens only (not the prompt's, not the padding's)."
    ),
    formula="shaped[b] = rewards[b] - kl_coef * sum over t of mask[b, t] * (logprobs[b, t] - ref_logprobs[b, t]), "
    "one number per reply; the mask may hold 0./1. floats or bools.",
    solution=_solutions.kl_shaped_rewards,
)


@with_hints(_HINTS_KL)
def check_kl_shaped_rewards(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``kl_shaped_rewards(rewards, logprobs, ref_logprobs, mask, kl_coef)``: rewards (B,),
    per-token log-probs and mask (B, T) -> (B,) shaped rewards; with float and bool masks."""
    return run_checker(
        "Exercise 8.3 kl_shaped_rewards",
        fn,
        _library_kl,
        _kl_cases(),
        diagnoses=_KL_DIAGNOSES,
        compare=lambda got, expected: compare_tensors(got, expected, rtol=1e-5, atol=1e-5),
        verbose=verbose,
        hints=_HINTS_KL,
    )
