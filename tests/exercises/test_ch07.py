"""Chapter 7 checkers: pass the reference and the worked solutions, reject realistic buggy versions by name."""

import pytest
import torch

from edurl import exercises
from edurl.exercises import FAILED, NOT_ATTEMPTED, PASSED
from edurl.exercises.solutions import ch07
from edurl.llm.datum import Datum, ModelInput
from edurl.llm.datum import build_datum as reference_datum
from edurl.llm.losses import group_advantages as reference_advantages
from edurl.llm.losses import ppo as reference_ppo

from .conftest import assert_rejected

# ---------------------------------------------------------------- 7.1 group_advantages


def ga_batch_mean(rewards):
    return rewards - rewards.mean()


def ga_grpo_std(rewards):
    return (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + 1e-6)


def ga_std_no_eps(rewards):
    return (rewards - rewards.mean(dim=1, keepdim=True)) / rewards.std(dim=1, keepdim=True)


def ga_raw(rewards):
    return rewards


def ga_dim0(rewards):
    return rewards - rewards.mean(dim=0, keepdim=True)


def ga_no_keepdim(rewards):
    return rewards - rewards.mean(dim=1)


def ga_in_place(rewards):
    rewards -= rewards.mean(dim=1, keepdim=True)
    return rewards


def ga_numpy(rewards):
    r = rewards.numpy()
    return r - r.mean(axis=1, keepdims=True)


@pytest.mark.parametrize(
    "fn", [reference_advantages, ch07.group_advantages, lambda r: r - r.sum(dim=1, keepdim=True) / r.shape[1]]
)
def test_group_advantages_checker_passes(fn):
    assert exercises.check_group_advantages(fn, verbose=False).status == PASSED


@pytest.mark.parametrize(
    "buggy, message",
    [
        (ga_batch_mean, "mean over the whole batch"),
        (ga_grpo_std, "divided by a std (the group's"),
        (ga_std_no_eps, "divided by a std (the group's"),
        (lambda r: (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4), "divided by a std (the group's"),
        (ga_raw, "returned the rewards unchanged"),
        (ga_dim0, "mean over dim=0"),
        (ga_no_keepdim, "keepdim=True"),
        (ga_in_place, "changed its input `rewards` in place"),
        (ga_numpy, "a NumPy array"),
    ],
)
def test_group_advantages_checker_rejects(buggy, message):
    verdict = assert_rejected(exercises.check_group_advantages, buggy, message)
    assert verdict.implementation is not buggy


def test_group_advantages_worked_example_and_zero_variance_group():
    # mean .625 -> [.375, -.125, -.625, .375]; a group of equal rewards gets exactly 0
    rewards = torch.tensor([[1.0, 0.5, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    expected = torch.tensor([[0.375, -0.125, -0.625, 0.375], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(ch07.group_advantages(rewards), expected)
    # the std-scaled version divides 0 by 0 on that group: the checker's NaN report names it
    verdict = exercises.check_group_advantages(
        lambda r: ga_std_no_eps(r) if (r == r[:, :1]).all() else r - r.mean(dim=1, keepdim=True), verbose=False
    )
    assert (
        verdict.status == FAILED and "got NaN" in verdict.message and "divided by a std (the group's" in verdict.message
    )


# ---------------------------------------------------------------- 7.3 ppo_loss


def ppo_max(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
    r = torch.exp(lp - q)
    return -torch.max(r * adv, torch.clamp(r, clip_low_threshold, clip_high_threshold) * adv)


def ppo_no_minus(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
    r = torch.exp(lp - q)
    return torch.min(r * adv, torch.clamp(r, clip_low_threshold, clip_high_threshold) * adv)


def ppo_only_clipped(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
    return -torch.clamp(torch.exp(lp - q), clip_low_threshold, clip_high_threshold) * adv


def ppo_divided_logprobs(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
    r = lp / q
    return -torch.min(r * adv, torch.clamp(r, clip_low_threshold, clip_high_threshold) * adv)


def ppo_inverted(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
    r = torch.exp(q - lp)
    return -torch.min(r * adv, torch.clamp(r, clip_low_threshold, clip_high_threshold) * adv)


def ppo_clip_advantage(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
    r = torch.exp(lp - q)
    return -torch.min(r * adv, r * torch.clamp(adv, clip_low_threshold, clip_high_threshold))


def ppo_clip_product(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
    r = torch.exp(lp - q)
    return -torch.min(r * adv, torch.clamp(r * adv, clip_low_threshold, clip_high_threshold))


def ppo_detached(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
    r = torch.exp(lp - q).detach()
    return -torch.min(r * adv, torch.clamp(r, clip_low_threshold, clip_high_threshold) * adv)


def ppo_eps_bounds(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
    r = torch.exp(lp - q)
    return -torch.min(r * adv, torch.clamp(r, 1 - clip_low_threshold, 1 + clip_high_threshold) * adv)


def ppo_unclipped(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
    return -torch.exp(lp - q) * adv


def ppo_mean(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
    return ch07.ppo_loss(lp, q, adv, clip_low_threshold, clip_high_threshold).mean()


def ppo_probabilities(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
    r = lp.exp() / q.exp()
    return -torch.minimum(r * adv, r.clamp(clip_low_threshold, clip_high_threshold) * adv)


def ppo_log_ratio_in_place(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
    lp -= q  # torch refuses this on a leaf; its error once reached the learner as it was
    r = lp.exp()
    return -torch.min(r * adv, r.clamp(clip_low_threshold, clip_high_threshold) * adv)


@pytest.mark.parametrize("fn", [reference_ppo, ch07.ppo_loss, ppo_probabilities])
def test_ppo_loss_checker_passes(fn):
    assert exercises.check_ppo_loss(fn, verbose=False).status == PASSED


@pytest.mark.parametrize(
    "buggy, message",
    [
        (ppo_max, "max() instead of min()"),
        (ppo_no_minus, "the sign is flipped"),
        (ppo_only_clipped, "without the min()"),
        (ppo_divided_logprobs, "not train_logprobs / sampling_logprobs"),
        (ppo_inverted, "the ratio is upside down"),
        (ppo_clip_advantage, "you clipped the advantage"),
        (ppo_clip_product, "you clipped the product r*A"),
        (ppo_detached, "the ratio was detached"),
        (ppo_eps_bounds, "not clamp(r, 1 - clip_low_threshold, 1 + clip_high_threshold)"),
        (ppo_unclipped, "nothing is clipped"),
        (ppo_mean, "Do not reduce it"),
        (ppo_log_ratio_in_place, "changed a tensor that needs a gradient in place (at line"),
    ],
)
def test_ppo_loss_checker_rejects(buggy, message):
    verdict = assert_rejected(exercises.check_ppo_loss, buggy, message)
    assert verdict.implementation is not buggy


def test_ppo_loss_gradient_is_checked_not_only_values():
    # same values as PPO, but the gradient leaks through the clipped branch: the checker must see it
    def straight_through(lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2):
        r = torch.exp(lp - q)
        clipped = r + (r.clamp(clip_low_threshold, clip_high_threshold) - r).detach()
        return -torch.min(r * adv, clipped * adv)

    assert_rejected(exercises.check_ppo_loss, straight_through, "d loss / d train_logprobs: values differ")


# ---------------------------------------------------------------- 7.2 build_datums (checked as masked_datums)


def _datum(prompt, tokens, lps, adv, *, n_zeros=None, advs=None, mask=None, drop_last=False):
    """A learner-style Datum with hand-written field layouts (n_zeros prompt zeros, then the completion)."""
    seq = list(prompt) + list(tokens)
    n = len(prompt) - 1 if n_zeros is None else n_zeros
    fields = {
        "logprobs": [0.0] * n + list(lps),
        "advantages": advs if advs is not None else [0.0] * n + [float(adv)] * len(tokens),
        "mask": mask if mask is not None else [0.0] * n + [1.0] * len(tokens),
    }
    if drop_last:
        fields = {k: v[:-1] for k, v in fields.items()}
    return Datum(
        ModelInput.from_ints(seq[:-1]),
        {"target_tokens": torch.tensor(seq[1:]), **{k: torch.tensor(v) for k, v in fields.items()}},
    )


def bd_unmasked(prompt, completions, advantages):
    return [
        _datum(prompt, t, lp, a, advs=[float(a)] * (len(prompt) + len(t) - 1), mask=[1.0] * (len(prompt) + len(t) - 1))
        for (t, lp), a in zip(completions, advantages)
    ]


def bd_off_by_one(prompt, completions, advantages):
    return [
        _datum(prompt, t, lp, a, n_zeros=len(prompt), drop_last=True) for (t, lp), a in zip(completions, advantages)
    ]


def bd_first_advantage(prompt, completions, advantages):
    return [_datum(prompt, t, lp, advantages[0]) for t, lp in completions]


def bd_last_token_only(prompt, completions, advantages):
    return [
        _datum(prompt, t, lp, a, advs=[0.0] * (len(prompt) + len(t) - 2) + [float(a)])
        for (t, lp), a in zip(completions, advantages)
    ]


def bd_reference_loop(prompt, completions, advantages):
    return [reference_datum(prompt, t, lp, a) for (t, lp), a in zip(completions, advantages)]


@pytest.mark.parametrize(
    "fn",
    [bd_reference_loop, ch07.build_datums, lambda p, c, a: tuple(reference_datum(p, *ci, ai) for ci, ai in zip(c, a))],
)
def test_masked_datums_checker_passes(fn):
    assert exercises.check_masked_datums(fn, verbose=False).status == PASSED


@pytest.mark.parametrize(
    "buggy, message",
    [
        (bd_unmasked, "the prompt is not masked"),
        (bd_off_by_one, "off by one"),
        (bd_first_advantage, "every completion got the same advantage"),
        (bd_last_token_only, "only the last token carries the advantage"),
        (lambda p, c, a: bd_reference_loop(p, c, a)[0], "got a single Datum"),
        (lambda p, c, a: (reference_datum(p, *ci, ai) for ci, ai in zip(c, a)), "got generator (a generator, used"),
        (lambda p, c, a: bd_reference_loop(p, c[:1], a[:1]), "one Datum per completion"),
    ],
)
def test_masked_datums_checker_rejects(buggy, message):
    assert_rejected(exercises.check_masked_datums, buggy, message)


def test_masked_datums_names_the_completion_that_is_wrong():
    # completion 0 has advantages[0] either way; completion 1 is the first that differs
    verdict = exercises.check_masked_datums(bd_first_advantage, verbose=False)
    assert "datum 1, advantages: values differ" in verdict.message


# ---------------------------------------------------------------- all three


@pytest.mark.parametrize(
    "check", [exercises.check_group_advantages, exercises.check_ppo_loss, exercises.check_masked_datums]
)
def test_stub_is_not_attempted(check):
    def stub(*args):
        raise NotImplementedError

    verdict = check(stub, verbose=False)
    assert verdict.status == NOT_ATTEMPTED and verdict.implementation is not stub


def test_solutions_are_registered_under_chapter_7():
    assert {name for name, (chapter, _, _) in exercises.EXERCISES.items() if chapter == 7} == {
        "group_advantages",
        "ppo_loss",
        "masked_datums",
        "grpo_step",
    }
    assert "keepdim=True" in exercises.show_solution("group_advantages")
    assert "torch.min" in exercises.show_solution("ppo_loss")
    assert "build_datum(prompt_tokens" in exercises.show_solution("masked_datums")
    assert "save_weights_and_get_sampling_client" in exercises.show_solution("grpo_step")


def test_checkers_print_the_verdict_unless_quiet(capsys):
    exercises.check_ppo_loss(ch07.ppo_loss, verbose=False)
    assert capsys.readouterr().out == ""
    exercises.check_group_advantages(ga_raw)
    assert "Exercise 7.1 group_advantages: failed" in capsys.readouterr().out
