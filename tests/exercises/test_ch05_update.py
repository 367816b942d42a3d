"""Exercises 5.2 (the clipped objective's values by hand) and 5.3 (PPO's whole update, checked step by step beside
the library's); each realistic bug is named."""

import dataclasses

import pytest
import torch

from edurl import exercises
from edurl.exercises import NOT_ATTEMPTED, PASSED
from edurl.exercises.ch05 import CLIP_VALUE_CASES, _buggy_update, reference_clip_values
from edurl.exercises.solutions import ch05
from edurl.rl.ppo import ppo_update

from .conftest import assert_rejected

# ---------------------------------------------------------------- 5.2


def test_clip_values_reference_by_hand():
    # computed on paper: r*A, clip(r, 0.8, 1.2)*A, and the smaller of the two
    assert reference_clip_values() == {
        (2.0, 1.5): (3.0, 2.4, 2.4),
        (2.0, 0.5): (1.0, 1.6, 1.0),
        (-1.0, 0.5): (-0.5, -0.8, -0.8),
        (-1.0, 1.5): (-1.5, -1.2, -1.5),
        (1.0, 1.1): (1.1, 1.1, 1.1),
    }
    assert ch05.clip_values() == reference_clip_values()


def test_clip_values_passes_and_blank_is_not_attempted():
    assert exercises.check_clip_values(ch05.clip_values(), verbose=False).status == PASSED
    # rows as lists, or numbers as 0-dim tensors (computed with torch), were once rejected as "not a tuple" and
    # "tensor(3.) is not" the unclipped term
    as_lists = {key: list(row) for key, row in ch05.clip_values().items()}
    as_tensors = {key: tuple(map(torch.tensor, row)) for key, row in ch05.clip_values().items()}
    for table in (as_lists, as_tensors):
        verdict = exercises.check_clip_values(table, verbose=False)
        assert verdict.status == PASSED, verdict.message
    import numpy as np

    as_numpy = {key: tuple(map(np.float32, row)) for key, row in ch05.clip_values().items()}  # np.float32(1.1)
    verdict = exercises.check_clip_values(as_numpy, verbose=False)
    assert verdict.status == PASSED, verdict.message
    blank_lists = {key: [None, None, None] for key in CLIP_VALUE_CASES}
    assert exercises.check_clip_values(blank_lists, verbose=False).status == NOT_ATTEMPTED
    blank = {key: (None, None, None) for key in CLIP_VALUE_CASES}
    assert exercises.check_clip_values(blank, verbose=False).status == NOT_ATTEMPTED


def _values(**rows):
    table = dict(ch05.clip_values())
    for key, row in rows.items():
        table[key] = row
    return table


@pytest.mark.parametrize(
    "table, message",
    [
        # clipping the product instead of the ratio: clip(3.0) = 1.2
        ({**ch05.clip_values(), (2.0, 1.5): (3.0, 1.2, 1.2)}, "you clipped the product r * A"),
        # the larger term
        ({**ch05.clip_values(), (2.0, 0.5): (1.0, 1.6, 1.6)}, "you took the larger term"),
        # for A < 0, taking the term closer to zero
        ({**ch05.clip_values(), (-1.0, 0.5): (-0.5, -0.8, -0.5)}, "you took the larger term"),
        # forgetting that r = 0.5 is outside the range
        ({**ch05.clip_values(), (-1.0, 0.5): (-0.5, -0.5, -0.5)}, "outside [0.8, 1.2]"),
        ({**ch05.clip_values(), (1.0, 1.1): (1.0, 1.1, 1.1)}, "the unclipped term is the ratio times the advantage"),
        ({**ch05.clip_values(), (1.0, 1.1): [1.1, 1.1]}, "expected a tuple of three numbers"),
        ({**ch05.clip_values(), (2.0, 0.5): (1.0, 1.6, torch.tensor([1.0, 1.0]))}, "not a string or a tensor of"),
        ({**ch05.clip_values(), (2.0, 0.5): (1.0, 1.6, "1.0")}, "not a string"),
        # a half-filled row was told to 'write each as a plain number (not a tensor)', which a tensor may be
        ({**ch05.clip_values(), (2.0, 0.5): (1.0, None, None)}, "row A = +2, r = 0.5 is not filled in yet"),
        # with A < 0 the smaller term is the more negative: said with the diagnosis that fires
        ({**ch05.clip_values(), (-1.0, 1.5): (-1.5, -1.2, -1.2)}, "both terms are negative"),
    ],
)
def test_clip_values_rejects(table, message):
    assert_rejected(exercises.check_clip_values, table, message)


# ---------------------------------------------------------------- 5.3


@pytest.mark.parametrize("fn", [ppo_update, ch05.ppo_update])
def test_ppo_update_checker_passes(fn):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    verdict = exercises.check_ppo_update(fn, verbose=False)
    assert verdict.status == PASSED and verdict.implementation is fn, verdict.message
    assert torch.equal(torch.rand(3), expected)  # the learner's torch seed is left as it was (it was reseeded)


@pytest.mark.parametrize(
    "bug, message",
    [
        ("no clip", "never clipped"),
        ("clip only", "only the clipped term"),
        ("max", "optimistic (larger)"),
        ("ratio to current", "against the current policy"),
        ("no normalisation", "not standardised"),
        ("batch normalisation", "over the whole batch"),
        ("population std", "the population std"),
        ("adam eps", "adds 1e-5 to the std"),
        ("no entropy", "the entropy bonus is missing"),
        ("no zero_grad", "zero them before backward()"),
        ("no grad clip", "not clipped at config.max_grad_norm"),
        # each was once 'not clipped at config.max_grad_norm', or named nothing
        ("policy grad clip", "only the policy's gradient is clipped"),
        ("grad clip per net", "clipped each on its own"),
        ("inverted ratio", "the ratio is upside down"),
        ("min of ratios", "the min is taken of the ratios"),
        ("no half", "half the mean squared error"),
        ("no vf_coef", "not weighted by config.vf_coef"),
        ("entropy sign", "the entropy bonus has the wrong sign"),
        ("no reshuffle", "same order every epoch"),
        ("one epoch", "one pass over the batch"),
        # both once passed: the checker's clip and grad-norm equalled PPOConfig's defaults
        ("config clip", "not the clip_eps argument"),
        ("fixed grad clip", "clipped at 0.5"),
    ],
)
def test_ppo_update_checker_names_each_bug(bug, message):
    verdict = assert_rejected(exercises.check_ppo_update, _buggy_update(bug), message)
    assert verdict.implementation is ppo_update


def _update_with(eps=1e-8, ent_scale=1.0, ratio_dtype=torch.float64, draw_once=False):
    """The solution's update with one constant or one precision changed: eps in the standardisation, the entropy
    bonus scaled, or the ratio rounded through another dtype; or the minibatches drawn once, before the epochs."""

    def update(policy, value, optimizer, batch, config, clip_eps):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        drawn = batch.minibatches(config.num_minibatches)  # a generator: used up after one epoch
        for _ in range(config.update_epochs):
            for idx in drawn if draw_once else batch.minibatches(config.num_minibatches):
                lp, ent = policy.logprob_and_entropy(batch.obs[idx], batch.actions[idx])
                adv = batch.advantages[idx]
                adv = (adv - adv.mean()) / (adv.std() + eps)
                ratio = torch.exp(lp - batch.sampling_logprobs[idx]).to(ratio_dtype).to(lp.dtype)
                policy_loss = -torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv).mean()
                value_loss = 0.5 * ((value(batch.obs[idx]) - batch.returns[idx]) ** 2).mean()
                loss = policy_loss + config.vf_coef * value_loss - ent_scale * config.ent_coef * ent.mean()
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
                optimizer.step()

    return update


@pytest.mark.parametrize("eps, ent_scale", [(1e-6, 1.0), (1e-8, 32.0)])
def test_ppo_update_checker_points_at_small_terms_when_the_gradients_nearly_match(eps, ent_scale):
    """Another eps in the standardisation, or the entropy bonus summed instead of averaged (32 times its size): on the
    check batch both move the gradients by less than 0.1 %, which this exact check rejects. No known mistake matches,
    so the message points at the small terms, without claiming the rest is right."""

    verdict = assert_rejected(
        exercises.check_ppo_update, _update_with(eps, ent_scale), "look at what moves the gradient very little"
    )
    assert "(adv.std() + 1e-8)" in verdict.message and "entropy bonus" in verdict.message, verdict.message
    assert "likely mistake" not in verdict.message
    # a mistake that moves the gradients more is not sent to the small terms
    assert "very little" not in assert_rejected(exercises.check_ppo_update, _buggy_update("no half"), "").message


def test_ppo_update_checker_stub_crash_and_no_step():
    def stub(*args):
        raise NotImplementedError

    assert exercises.check_ppo_update(stub, verbose=False).status == NOT_ATTEMPTED

    def crash(policy, value, optimizer, batch, config, clip_eps):
        return batch.obs @ torch.ones(3)

    assert "raised RuntimeError (at line" in assert_rejected(exercises.check_ppo_update, crash, "raised").message
    assert_rejected(exercises.check_ppo_update, lambda *args: None, "never updated")


def test_ppo_update_checker_names_a_float32_cast_that_only_the_final_weights_show():
    """A ratio rounded through float32 keeps every step's gradients inside their tolerance, but not the final weights:
    the message says what such a small difference usually is, not only 'outside the optimizer's steps'."""

    verdict = assert_rejected(exercises.check_ppo_update, _update_with(ratio_dtype=torch.float32), "cast to float32")
    assert "final weights differ" in verdict.message, verdict.message


def test_ppo_update_checker_catches_weights_changed_outside_the_optimizer():
    def nudged(policy, value, optimizer, batch, config, clip_eps):
        ppo_update(policy, value, optimizer, batch, config, clip_eps)
        with torch.no_grad():
            next(policy.parameters()).mul_(1.01)  # e.g. a hand-made "extra" step after the last one

    verdict = assert_rejected(exercises.check_ppo_update, nudged, "the final weights differ")
    assert "float32" not in verdict.message  # a 1 % nudge is not rounding


def test_ppo_update_checker_names_minibatches_drawn_once_before_the_epochs():
    """batch.minibatches(...) called once, before the epoch loop: its generator is spent after the first epoch, so
    only 4 steps are taken; the message once said "one pass over the batch" to a learner who loops over epochs."""
    assert_rejected(exercises.check_ppo_update, _update_with(draw_once=True), "inside the epoch loop")


def test_ppo_update_checker_names_an_optimizer_of_ones_own():
    """An update that builds its own Adam changes the weights but never steps the given optimizer: it was once told
    "the weights were never updated"."""

    def own_adam(policy, value, optimizer, batch, config, clip_eps):
        mine = torch.optim.Adam([*policy.parameters(), *value.parameters()], lr=0.03, eps=1e-5)
        ch05.ppo_update(policy, value, mine, batch, config, clip_eps)

    verdict = assert_rejected(exercises.check_ppo_update, own_adam, "use the optimizer you were given")
    assert "never updated" not in verdict.message


def _counting_update(count):
    """The worked solution, with the policy loss's mean written as a sum over a count of the minibatch."""

    def update(policy, value, optimizer, batch, config, clip_eps):
        params = list(policy.parameters()) + list(value.parameters())
        for _epoch in range(config.update_epochs):
            for idx in batch.minibatches(config.num_minibatches):
                logprobs, entropy = policy.logprob_and_entropy(batch.obs[idx], batch.actions[idx])
                adv = batch.advantages[idx]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                ratio = torch.exp(logprobs - batch.sampling_logprobs[idx])
                clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
                policy_loss = -torch.min(ratio * adv, clipped).sum() / count(idx, adv)
                value_loss = 0.5 * ((value(batch.obs[idx]) - batch.returns[idx]) ** 2).mean()
                loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy.mean()
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
                optimizer.step()

    return update


def test_ppo_update_checker_tries_one_minibatch_as_train_ppo_runs_by_default():
    """With 4 minibatches idx is a tensor, so len(idx) passed; train_ppo's default of 1 minibatch gives slice(None),
    and the update that had passed then crashed in training. Counting from the indexed tensor passes."""
    verdict = assert_rejected(exercises.check_ppo_update, _counting_update(lambda idx, adv: len(idx)), "slice(None)")
    assert "num_minibatches=1" in verdict.message and "TypeError" in verdict.message
    verdict = exercises.check_ppo_update(_counting_update(lambda idx, adv: adv.numel()), verbose=False)
    assert verdict.status == PASSED, verdict.message

    def whole_batch_twice(policy, value, optimizer, batch, config, clip_eps):  # right with 4 minibatches only
        if config.num_minibatches == 1:
            config = dataclasses.replace(config, update_epochs=1)
        ch05.ppo_update(policy, value, optimizer, batch, config, clip_eps)

    assert_rejected(exercises.check_ppo_update, whole_batch_twice, "took 1 optimizer steps, expected 2")
