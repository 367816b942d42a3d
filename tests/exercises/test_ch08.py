"""Chapter 8 checkers: pass the reference and the worked solutions, reject realistic buggy versions by name."""

import pytest
import torch
import torch.nn.functional as F

from edurl import exercises
from edurl.exercises import FAILED, NOT_ATTEMPTED, PASSED
from edurl.exercises.solutions import ch08
from edurl.llm import preference

from .conftest import assert_rejected

# ---------------------------------------------------------------- 8.1 bradley_terry_loss


def bt_swapped(chosen, rejected):
    return -F.logsigmoid(rejected - chosen).mean()


def bt_sum(chosen, rejected):
    return -F.logsigmoid(chosen - rejected).sum()


def bt_log_of_sigmoid(chosen, rejected):
    return -torch.log(torch.sigmoid(chosen - rejected)).mean()


def bt_log_one_plus_exp(chosen, rejected):
    return torch.log(1 + torch.exp(rejected - chosen)).mean()


def bt_clamped_sigmoid(chosen, rejected):
    # the usual "fix" for the NaN: finite, but every pair's loss is capped at -log(1e-8) = 18.4
    return -torch.log(torch.sigmoid(chosen - rejected).clamp(min=1e-8)).mean()


def bt_epsilon_1e6(chosen, rejected):
    return -torch.log(torch.sigmoid(chosen - rejected) + 1e-6).mean()  # only 1e-8 was named before


def bt_in_float64(chosen, rejected):
    # the overflow moves from a margin of -88.7 to -709.8: passed before the checker's margin of -1000
    return -torch.log(torch.sigmoid((chosen - rejected).double())).mean().to(chosen.dtype)


def bt_clamped_margin(chosen, rejected):
    return -F.logsigmoid((chosen - rejected).clamp(-100, 100)).mean()  # passed too: wrong only past |margin| 100


def bt_relu_form(chosen, rejected):
    x = chosen - rejected  # -log sigmoid(x) = max(-x, 0) + log(1 + exp(-|x|)), stable, but kinked at x = 0
    return (torch.relu(-x) + torch.log1p(torch.exp(-x.abs()))).mean()


def bt_sigmoid_no_log(chosen, rejected):
    return torch.sigmoid(rejected - chosen).mean()


def bt_minus_sigmoid(chosen, rejected):
    return -torch.sigmoid(chosen - rejected).mean()


def bt_log_of_difference(chosen, rejected):
    return -torch.log(chosen - rejected).mean()


def bt_rejected_detached(chosen, rejected):
    return -F.logsigmoid(chosen - rejected.detach()).mean()


def bt_all_detached(chosen, rejected):
    return -F.logsigmoid((chosen - rejected).detach()).mean()


def bt_item(chosen, rejected):
    return -F.logsigmoid(chosen - rejected).mean().item()


def bt_per_pair(chosen, rejected):
    return -F.logsigmoid(chosen - rejected)


@pytest.mark.parametrize(
    "fn",
    [
        preference.bradley_terry_loss,
        ch08.bradley_terry_loss,
        lambda c, r: F.softplus(r - c).mean(),
        lambda c, r: F.binary_cross_entropy_with_logits(c - r, torch.ones_like(c)),
        lambda c, r: (torch.maximum(r - c, torch.zeros_like(c)) + torch.log1p(torch.exp(-(c - r).abs()))).mean(),
    ],
)
def test_bradley_terry_checker_passes(fn):
    verdict = exercises.check_bradley_terry_loss(fn, verbose=False)
    assert verdict.status == PASSED and verdict.implementation is fn


@pytest.mark.parametrize(
    "buggy, message",
    [
        (bt_swapped, "chosen and rejected are swapped"),
        (bt_sum, "take the mean over pairs"),
        (bt_log_of_sigmoid, "not numerically stable"),
        (bt_log_one_plus_exp, "not numerically stable"),
        (bt_clamped_sigmoid, "not numerically stable"),
        (bt_epsilon_1e6, "not numerically stable"),
        (bt_in_float64, "not numerically stable"),
        (bt_clamped_margin, "not numerically stable"),
        (bt_relu_form, "its gradient at a margin of exactly 0 is not"),
        (bt_sigmoid_no_log, "the sigmoid without the log"),
        (bt_minus_sigmoid, "the sigmoid without the log"),
        (bt_log_of_difference, "the log of the reward difference"),
        (bt_rejected_detached, "it was detached"),
        (bt_all_detached, "loss has no gradient"),
        (bt_item, "did you call .item()"),
        (bt_per_pair, "reduce it with .mean()"),
    ],
)
def test_bradley_terry_checker_rejects(buggy, message):
    verdict = assert_rejected(exercises.check_bradley_terry_loss, buggy, message)
    assert verdict.implementation is preference.bradley_terry_loss


def test_bradley_terry_instability_shows_on_the_large_margins():
    verdict = exercises.check_bradley_terry_loss(bt_log_of_sigmoid, verbose=False)
    assert verdict.case.startswith("large margins") and "got inf" in verdict.message
    # a swapped loss has the right value at equal rewards: the gradient gives it away
    verdict = exercises.check_bradley_terry_loss(bt_swapped, verbose=False)
    assert verdict.case.startswith("equal rewards") and "d loss / d chosen_rewards: values differ" in verdict.message


# ---------------------------------------------------------------- 8.2 dpo_loss


def dpo_no_reference(pc, pr, rc, rr, beta):
    return -F.logsigmoid(beta * (pc - pr)).mean()


def dpo_beta_outside(pc, pr, rc, rr, beta):
    return -beta * F.logsigmoid((pc - rc) - (pr - rr)).mean()


def dpo_divided_by_beta(pc, pr, rc, rr, beta):
    return -F.logsigmoid(((pc - rc) - (pr - rr)) / beta).mean()


def dpo_no_beta(pc, pr, rc, rr, beta):
    return -F.logsigmoid((pc - rc) - (pr - rr)).mean()


def dpo_swapped(pc, pr, rc, rr, beta):
    return -F.logsigmoid(beta * ((pr - rr) - (pc - rc))).mean()


def dpo_ratio_upside_down(pc, pr, rc, rr, beta):
    return -F.logsigmoid(beta * ((rc - pc) - (rr - pr))).mean()


def dpo_reference_added(pc, pr, rc, rr, beta):
    return -F.logsigmoid(beta * ((pc + rc) - (pr + rr))).mean()


def dpo_references_crossed(pc, pr, rc, rr, beta):
    return -F.logsigmoid(beta * ((pc - rr) - (pr - rc))).mean()


def dpo_sum(pc, pr, rc, rr, beta):
    return -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).sum()


def dpo_log_of_sigmoid(pc, pr, rc, rr, beta):
    return -torch.log(torch.sigmoid(beta * ((pc - rc) - (pr - rr)))).mean()


def dpo_detached_refs_explicitly(pc, pr, rc, rr, beta):
    rewards_c, rewards_r = beta * (pc - rc.detach()), beta * (pr - rr.detach())
    return preference.bradley_terry_loss(rewards_c, rewards_r)


@pytest.mark.parametrize("fn", [preference.dpo_loss, ch08.dpo_loss, dpo_detached_refs_explicitly])
def test_dpo_checker_passes(fn):
    verdict = exercises.check_dpo_loss(fn, verbose=False)
    assert verdict.status == PASSED and verdict.implementation is fn


def dpo_relu_form(pc, pr, rc, rr, beta):
    x = beta * ((pc - rc) - (pr - rr))  # stable, but max(-x, 0) as a relu has slope 0 at a margin of 0 (no hint before)
    return (torch.relu(-x) + torch.log1p(torch.exp(-x.abs()))).mean()


@pytest.mark.parametrize(
    "buggy, message",
    [
        (dpo_no_reference, "ignores the reference model"),
        (dpo_beta_outside, "beta multiplies the loss instead of the margin"),
        (dpo_divided_by_beta, "you divided the margin by beta"),
        (dpo_no_beta, "beta is missing"),
        (dpo_swapped, "chosen and rejected are swapped"),
        (dpo_ratio_upside_down, "the log-ratios are upside down"),
        (dpo_reference_added, "the reference log-probs enter with the wrong sign"),
        (dpo_references_crossed, "the reference log-probs enter with the wrong sign"),
        (dpo_sum, "take the mean over pairs"),
        (dpo_log_of_sigmoid, "not numerically stable"),
        # in float64 it overflows only past a margin of -709.8, which no case reached: it passed 8.2 and failed 8.1
        (
            lambda pc, pr, rc, rr, beta: dpo_log_of_sigmoid(*(t.double() for t in (pc, pr, rc, rr)), beta).to(pc.dtype),
            "not numerically stable",
        ),
        (dpo_relu_form, "its gradient at a margin of exactly 0 is not"),
        (lambda pc, pr, rc, rr, beta: dpo_sum(pc, pr, rc, rr, beta).detach(), "loss has no gradient"),
    ],
)
def test_dpo_checker_rejects(buggy, message):
    verdict = assert_rejected(exercises.check_dpo_loss, buggy, message)
    assert verdict.implementation is preference.dpo_loss


def test_dpo_reference_log_probs_are_constants_and_beta_varies():
    seen = []

    def spy(pc, pr, rc, rr, beta):
        seen.append((pc.requires_grad, pr.requires_grad, rc.requires_grad, rr.requires_grad, beta))
        return preference.dpo_loss(pc, pr, rc, rr, beta)

    assert exercises.check_dpo_loss(spy, verbose=False).status == PASSED
    assert all(s[:4] == (True, True, False, False) for s in seen)  # gradients for the policy's log-probs only
    assert {s[4] for s in seen} >= {0.1, 0.5}


# ---------------------------------------------------------------- 8.3 kl_shaped_rewards


def kl_unmasked(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return rewards - kl_coef * (logprobs - ref_logprobs).sum(-1)


def kl_added(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return rewards + kl_coef * (mask * (logprobs - ref_logprobs)).sum(-1)


def kl_ratio_reversed(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return rewards - kl_coef * (mask * (ref_logprobs - logprobs)).sum(-1)


def kl_mean_over_reply(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return rewards - kl_coef * (mask * (logprobs - ref_logprobs)).sum(-1) / mask.sum(-1)


def kl_mean_over_positions(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return rewards - kl_coef * (mask * (logprobs - ref_logprobs)).mean(-1)


def kl_coef_on_reward(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return kl_coef * rewards - (mask * (logprobs - ref_logprobs)).sum(-1)


def kl_coef_on_both(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return kl_coef * (rewards - (mask * (logprobs - ref_logprobs)).sum(-1))


def kl_per_token(rewards, logprobs, ref_logprobs, mask, kl_coef):
    return rewards.unsqueeze(1) - kl_coef * mask * (logprobs - ref_logprobs)


def kl_in_place(rewards, logprobs, ref_logprobs, mask, kl_coef):
    logprobs -= ref_logprobs
    return rewards - kl_coef * (mask * logprobs).sum(-1)


def kl_row_by_row(rewards, logprobs, ref_logprobs, mask, kl_coef):
    kl = torch.stack([(lp - ref)[m != 0].sum() for lp, ref, m in zip(logprobs, ref_logprobs, mask)])
    return rewards - kl_coef * kl


@pytest.mark.parametrize(
    "fn",
    [
        preference.kl_shaped_rewards,
        ch08.kl_shaped_rewards,
        lambda r, lp, ref, m, c: r - c * ((lp - ref) * m.to(lp.dtype)).sum(dim=1),
        kl_row_by_row,
    ],
)
def test_kl_shaped_rewards_checker_passes(fn):
    verdict = exercises.check_kl_shaped_rewards(fn, verbose=False)
    assert verdict.status == PASSED and verdict.implementation is fn


@pytest.mark.parametrize(
    "buggy, message",
    [
        (kl_unmasked, "the mask is ignored"),
        (kl_added, "the KL penalty has the wrong sign"),
        (kl_ratio_reversed, "the KL penalty has the wrong sign"),
        (kl_mean_over_reply, "you averaged the log-ratio over tokens"),
        (kl_mean_over_positions, "you averaged the log-ratio over tokens"),
        (kl_coef_on_reward, "kl_coef scales the reward model's score"),
        (kl_coef_on_both, "kl_coef scales the reward model's score"),
        (kl_per_token, "you returned one value per token"),
        (kl_in_place, "changed its input `logprobs` in place"),
    ],
)
def test_kl_shaped_rewards_checker_rejects(buggy, message):
    verdict = assert_rejected(exercises.check_kl_shaped_rewards, buggy, message)
    assert verdict.implementation is preference.kl_shaped_rewards


def test_kl_shaped_rewards_checks_float_and_bool_masks():
    dtypes = []

    def spy(rewards, logprobs, ref_logprobs, mask, kl_coef):
        dtypes.append(mask.dtype)
        return preference.kl_shaped_rewards(rewards, logprobs, ref_logprobs, mask, kl_coef)

    assert exercises.check_kl_shaped_rewards(spy, verbose=False).status == PASSED
    assert {torch.float32, torch.bool} <= set(dtypes)

    def bool_masks_only(rewards, logprobs, ref_logprobs, mask, kl_coef):
        log_ratio = torch.where(mask, logprobs - ref_logprobs, 0.0)
        return rewards - kl_coef * log_ratio.sum(-1)

    verdict = assert_rejected(
        exercises.check_kl_shaped_rewards, bool_masks_only, "mask = tensor(shape=(1, 4), dtype=float32)"
    )
    assert "raised RuntimeError" in verdict.message and "torch.where(mask, logprobs - ref_logprobs" in verdict.message


# ---------------------------------------------------------------- all three

CHECKERS = {
    "bradley_terry_loss": (exercises.check_bradley_terry_loss, preference.bradley_terry_loss),
    "dpo_loss": (exercises.check_dpo_loss, preference.dpo_loss),
    "kl_shaped_rewards": (exercises.check_kl_shaped_rewards, preference.kl_shaped_rewards),
}


@pytest.mark.parametrize("name", CHECKERS)
def test_stub_is_not_attempted_and_the_reference_takes_over(name):
    check, reference = CHECKERS[name]

    def stub(*args):
        raise NotImplementedError  # your code here

    verdict = check(stub, verbose=False)
    assert verdict.status == NOT_ATTEMPTED and verdict.implementation is reference


@pytest.mark.parametrize("name", CHECKERS)
def test_a_learners_error_shows_their_own_line(name):
    check, reference = CHECKERS[name]

    def broken(first, *rest):
        return first.logsigmoid_of_margin()

    verdict = check(broken, verbose=False)
    assert verdict.status == FAILED and verdict.implementation is reference
    assert "raised AttributeError" in verdict.message and "first.logsigmoid_of_margin()" in verdict.message
    assert "Traceback" not in verdict.message


@pytest.mark.parametrize("name", CHECKERS)
def test_three_levels_of_help_and_only_the_last_shows_code(name):
    check, _ = CHECKERS[name]
    verdict = check(lambda *args: torch.tensor(0.0), verbose=False)
    assert verdict.status == FAILED and "verdict.hint(1)" in verdict.message
    idea, formula, code = (verdict.hint(level) for level in (1, 2, 3))
    assert idea.startswith("Hint 1 of 3") and formula.startswith("Hint 2 of 3")
    assert all("def " not in text and "return " not in text for text in (idea, formula))
    assert f"def {name}(" in code and "return " in code
    assert code.endswith(exercises.show_solution(name)) and exercises.hint(name, 3) == code


def test_solutions_are_registered_under_chapter_8():
    assert {name for name, (chapter, _, _) in exercises.EXERCISES.items() if chapter == 8} == set(CHECKERS)
    assert "logsigmoid" in exercises.show_solution("bradley_terry_loss")
    assert "ref_chosen_logps" in exercises.show_solution("dpo_loss")
    assert "mask" in exercises.show_solution("kl_shaped_rewards")


def test_checkers_print_the_verdict_unless_quiet(capsys):
    exercises.check_dpo_loss(ch08.dpo_loss, verbose=False)
    assert capsys.readouterr().out == ""
    exercises.check_bradley_terry_loss(bt_swapped)
    out = capsys.readouterr().out
    assert "Exercise 8.1 bradley_terry_loss: failed" in out and "the likely mistake: chosen and rejected" in out
