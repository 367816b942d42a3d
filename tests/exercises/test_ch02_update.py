"""Exercise 2.2: the whole REINFORCE update, checked beside the library's; each realistic bug is named."""

import pytest
import torch

from edurl import exercises
from edurl.exercises import NOT_ATTEMPTED, PASSED
from edurl.exercises.solutions import ch02
from edurl.rl import collect_episodes, discounted_returns, reinforce_loss, reinforce_update

from .conftest import assert_rejected


def _update(weights_of, *, zero_grad=True, seeds_used=True, mask=True, step=True, order="zero_grad backward step"):
    """A learner's update with one knob per realistic mistake; the defaults are right. ``order`` is the order of the
    three optimizer calls; ``returns`` what the update returns as its loss."""

    def update(policy, optimizer, envs, seeds, gamma, device):
        batch = collect_episodes(envs, policy.act, device, seeds=seeds if seeds_used else None)
        returns = weights_of(batch, gamma)
        if mask:
            obs, actions, G = batch.obs[batch.mask], batch.actions[batch.mask], returns[batch.mask]
        else:
            obs, actions, G = batch.obs.flatten(0, 1), batch.actions.flatten(), returns.flatten()
        logprobs = policy(obs).log_prob(actions)
        loss = reinforce_loss(logprobs, G)
        calls = {"zero_grad": optimizer.zero_grad if zero_grad else None, "backward": loss.backward}
        calls["step"] = optimizer.step if step else None
        for name in order.split():
            if calls[name] is not None:
                calls[name]()
        return batch, loss

    return update


def _returning(loss_of):
    """The right update, returning ``loss_of(batch, loss)`` as its loss: a missing return, a step's own return,
    per-step terms; each made the checker raise (float() of None, of a tuple, of a vector)."""

    def update(policy, optimizer, envs, seeds, gamma, device):
        batch, loss = reinforce_update(policy, optimizer, envs, seeds, gamma, device)
        return batch, loss_of(batch, loss)

    return update


def reward_to_go(batch, gamma):
    return discounted_returns(batch.rewards, batch.dones, gamma)


def whole_return(batch, gamma):
    return batch.rewards.sum(0, keepdim=True).expand_as(batch.rewards)


def undiscounted(batch, gamma):
    return discounted_returns(batch.rewards, batch.dones, 1.0)


def rewards_only(batch, gamma):
    return batch.rewards  # the rewards themselves, not the reward-to-go


def default_gamma(batch, gamma):
    return discounted_returns(batch.rewards, batch.dones, 0.99)  # train_reinforce's default, not the argument


def as_list(policy, optimizer, envs, seeds, gamma, device):
    return list(reinforce_update(policy, optimizer, envs, seeds, gamma, device))  # train_reinforce unpacks a list


def ascent(policy, optimizer, envs, seeds, gamma, device):
    batch, loss = _update(reward_to_go, step=False)(policy, optimizer, envs, seeds, gamma, device)
    for p in policy.parameters():  # "gradient ascent" by hand: one SGD step the wrong way
        p.data.add_(p.grad, alpha=0.01)
    return batch, loss


@pytest.mark.parametrize("fn", [reinforce_update, ch02.reinforce_update, _update(reward_to_go), as_list])
def test_reinforce_update_checker_passes(fn):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    verdict = exercises.check_reinforce_update(fn, verbose=False)
    assert verdict.status == PASSED and verdict.implementation is fn, verdict.message
    assert torch.equal(torch.rand(3), expected)  # the learner's torch seed is left as it was (it was reseeded)


@pytest.mark.parametrize(
    "buggy, message",
    [
        (_update(reward_to_go, zero_grad=False), "zero them before backward()"),
        (_update(whole_return), "episode's *whole* return"),
        (_update(undiscounted), "not discounted"),
        (_update(default_gamma), "not with the gamma passed to your function"),
        (_update(rewards_only), "by its own reward r_t, not by the reward-to-go"),
        (_update(reward_to_go, mask=False), "padded steps"),
        (_update(reward_to_go, seeds_used=False), "resetting env i with seeds[i]"),
        (_update(reward_to_go, step=False), "did not change. Zero the gradients"),
        # the step runs with no gradient (after zero_grad, or before backward): Adam skips every parameter, and "take
        # the step" was said to a learner who did
        (_update(reward_to_go, order="backward zero_grad step"), "a step taken before backward() or after the zeroing"),
        (_update(reward_to_go, order="zero_grad step backward"), "a step taken before backward() or after the zeroing"),
        (_returning(lambda batch, loss: None), "one number, the loss you called backward() on, got None"),
        (_returning(lambda batch, loss: (batch, loss)), "got tuple"),
        (_returning(lambda batch, loss: loss.expand(3)), "a tensor of shape (3,): return the mean"),
        (_returning(lambda batch, loss: [loss.item()]), "got list"),  # train_reinforce logs float(loss)
        (ascent, "parameters after the step differ"),
        (lambda policy, optimizer, envs, seeds, gamma, device: None, "expected (batch, loss), got NoneType"),
    ],
)
def test_reinforce_update_checker_rejects(buggy, message):
    verdict = assert_rejected(exercises.check_reinforce_update, buggy, message)
    assert verdict.implementation is reinforce_update


def test_reinforce_update_checker_names_an_optimizer_of_ones_own():
    """A new Adam each update takes the same first step but forgets its running averages; it was once told to zero
    the gradients, though it does. The zero_grad hint stays for the update that really skips zero_grad."""

    def own_adam(policy, optimizer, envs, seeds, gamma, device):
        return reinforce_update(policy, torch.optim.Adam(policy.parameters(), lr=0.01), envs, seeds, gamma, device)

    verdict = assert_rejected(exercises.check_reinforce_update, own_adam, "use the optimizer you were given")
    assert "zero them" not in verdict.message
    verdict = assert_rejected(
        exercises.check_reinforce_update, _update(reward_to_go, zero_grad=False), "zero them before backward()"
    )
    assert "optimizer you were given" not in verdict.message


def test_reinforce_update_stub_and_crash():
    def stub(*args):
        raise NotImplementedError

    assert exercises.check_reinforce_update(stub, verbose=False).status == NOT_ATTEMPTED

    def crash(policy, optimizer, envs, seeds, gamma, device):
        return torch.zeros(2) @ torch.zeros(3)

    verdict = exercises.check_reinforce_update(crash, verbose=False)
    assert verdict.status == "failed" and "RuntimeError" in verdict.message and "torch.zeros(2) @" in verdict.message


def test_train_reinforce_runs_a_learners_update_and_refuses_what_it_cannot_use():
    from edurl.rl import ReinforceConfig, train_reinforce

    calls = []

    def mine(*args):
        calls.append(1)
        return reinforce_update(*args)

    config = ReinforceConfig(seed=1, max_episodes=32, progress=False)
    ours, theirs = train_reinforce(config, update_fn=mine), train_reinforce(config)
    assert len(calls) == 4 and ours.episodes["episode_return"].tolist() == theirs.episodes["episode_return"].tolist()
    with pytest.raises(ValueError, match="baseline='none'"):
        train_reinforce(ReinforceConfig(baseline="value", max_episodes=8), update_fn=mine)
    with pytest.raises(ValueError, match="not both"):
        train_reinforce(config, update_fn=mine, loss_fn=reinforce_loss)
