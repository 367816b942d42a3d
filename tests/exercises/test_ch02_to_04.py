"""Chapters 2–4 checkers: pass the reference and the worked solution, reject realistic buggy versions."""

import pytest
import torch

from edurl import exercises
from edurl.exercises import NOT_ATTEMPTED, PASSED
from edurl.exercises.solutions import ch02, ch03, ch04
from edurl.rl import gae, reinforce_loss

from .conftest import assert_rejected

# ---------------------------------------------------------------- 2.1 reinforce_loss


def rl_no_minus(logprobs, returns):
    returns = returns.detach()
    w = (returns - returns.mean()) / (returns.std() + 1e-8)
    return (logprobs * w).mean()


def rl_raw_returns(logprobs, returns):
    returns = returns.detach()
    return -(logprobs * returns).mean()


def rl_centred_only(logprobs, returns):
    returns = returns.detach()
    return -(logprobs * (returns - returns.mean())).mean()  # subtracts the mean but never divides by the std


def rl_population_std(logprobs, returns):
    returns = returns.detach()
    w = (returns - returns.mean()) / (returns.std(unbiased=False) + 1e-8)  # the population std, not torch's default
    return -(logprobs * w).mean()


def rl_probabilities(logprobs, returns):
    returns = returns.detach()
    probs = logprobs.exp()  # weights the probabilities instead of the log-probabilities
    return -(probs * (returns - returns.mean()) / (returns.std() + 1e-8)).mean()


def rl_no_eps(logprobs, returns):
    returns = returns.detach()
    return -(logprobs * (returns - returns.mean()) / returns.std()).mean()


def rl_sum(logprobs, returns):
    returns = returns.detach()
    return -(logprobs * (returns - returns.mean()) / (returns.std() + 1e-8)).sum()


def rl_not_detached(logprobs, returns):
    return -(logprobs * (returns - returns.mean()) / (returns.std() + 1e-8)).mean()  # passed before


def rl_no_minus_not_detached(logprobs, returns):
    return (logprobs * (returns - returns.mean()) / (returns.std() + 1e-8)).mean()


def rl_a_trailing_comma(logprobs, returns):
    return (-(logprobs * (returns - returns.mean()) / (returns.std() + 1e-8)).mean(),)  # passed, then 2.2 failed


def rl_writes_over_returns(logprobs, G):
    w = G.detach()  # shares the caller's memory (passed once 2.1 differentiated through the returns)
    w -= w.mean()
    w /= w.std() + 1e-8
    return -(logprobs * w).mean()


def rl_item(logprobs, returns):
    returns = returns.detach()
    return -(logprobs * (returns - returns.mean()) / (returns.std() + 1e-8)).mean().item()


@pytest.mark.parametrize("fn", [lambda lp, g: reinforce_loss(lp, g, normalize_advantages=True), ch02.reinforce_loss])
def test_reinforce_loss_checker_passes(fn):
    assert exercises.check_reinforce_loss(fn, verbose=False).status == PASSED


@pytest.mark.parametrize(
    "buggy, message",
    [
        (rl_no_minus, "sign is flipped"),
        (rl_raw_returns, "not normalised"),
        (rl_centred_only, "did not divide by the std"),
        (rl_population_std, "not std(unbiased=False)"),
        (rl_probabilities, "not grad pi"),
        (rl_no_eps, "add 1e-8"),
        (rl_sum, "mean over steps, not the sum"),
        (rl_item, "did you call .item()"),
        (rl_not_detached, "the loss sends a gradient into the returns"),
        (rl_no_minus_not_detached, "sign is flipped. Optimisers minimise"),
        (rl_no_minus_not_detached, "Detach the returns too"),
        (rl_a_trailing_comma, "a trailing comma"),
        (rl_writes_over_returns, "changed its input `G` in place"),
    ],
)
def test_reinforce_loss_checker_rejects(buggy, message):
    assert_rejected(exercises.check_reinforce_loss, buggy, message)


# ---------------------------------------------------------------- 3.1 baseline_losses


def bl_not_detached(logprobs, returns, values):
    adv = returns - values
    return -(logprobs * adv).mean(), ((values - returns) ** 2).mean() / 2


def bl_value_detached(logprobs, returns, values):
    adv = (returns - values).detach()
    return -(logprobs * adv).mean(), 0.5 * ((values.detach() - returns) ** 2).mean()


def bl_flipped(logprobs, returns, values):
    adv = (values - returns).detach()
    return -(logprobs * adv).mean(), 0.5 * ((values - returns) ** 2).mean()


def bl_no_minus(logprobs, returns, values):
    adv = (returns - values).detach()
    return (logprobs * adv).mean(), 0.5 * ((values - returns) ** 2).mean()  # the advantage is right, the sign not


def bl_no_return(logprobs, returns, values):
    adv = (returns - values).detach()
    policy_loss, value_loss = -(logprobs * adv).mean(), 0.5 * ((values - returns) ** 2).mean()  # noqa: F841


def bl_in_place(logprobs, returns, values):
    values -= returns  # the critic's output edited in place
    return -(logprobs * (-values).detach()).mean(), 0.5 * (values**2).mean()


def bl_value_loss_no_half(logprobs, returns, values):
    adv = (returns - values).detach()
    return -(logprobs * adv).mean(), ((values - returns) ** 2).mean()


def bl_no_baseline(logprobs, returns, values):
    return -(logprobs * returns).mean(), 0.5 * ((values - returns) ** 2).mean()  # the critic is never used


def bl_as_a_list(logprobs, returns, values):
    """[policy_loss, value_loss]: it unpacks as the tuple does, and was rejected with "got 1 output(s)"."""
    return list(ch03.baseline_losses(logprobs, returns, values))


@pytest.mark.parametrize("fn", [exercises.ch03.baseline_losses, ch03.baseline_losses, bl_as_a_list])
def test_baseline_checker_passes(fn):
    assert exercises.check_baseline_losses(fn, verbose=False).status == PASSED


@pytest.mark.parametrize(
    "buggy, message",
    [
        (bl_not_detached, "sends gradients into the critic"),
        (bl_value_detached, "value_loss has no gradient"),
        (bl_flipped, "upside down"),
        (bl_no_minus, "lacks its minus sign"),
        (bl_no_return, "forget the `return` statement"),
        (bl_in_place, "changed a tensor that needs a gradient in place (at line"),
        (bl_value_loss_no_half, "value_loss: values differ"),
        (bl_no_baseline, "ignores the baseline"),
    ],
)
def test_baseline_checker_rejects(buggy, message):
    assert_rejected(exercises.check_baseline_losses, buggy, message)


# ---------------------------------------------------------------- 4.1 gae


def _gae_loop(rewards, values, next_values, terminated, truncated, gamma, lam, *, boot_mask, reset_mask, forward=False):
    deltas = rewards + gamma * next_values * (~boot_mask).float() - values
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[0])
    steps = range(len(rewards)) if forward else reversed(range(len(rewards)))
    for t in steps:
        if forward:
            running = deltas[t] + gamma * lam * running
            adv[t] = running
            running = running * (~reset_mask[t]).float()
        else:
            running = deltas[t] + gamma * lam * (~reset_mask[t]).float() * running
            adv[t] = running
    return adv, adv + values


def gae_through_terminal(r, v, nv, term, trunc, gamma, lam):
    return _gae_loop(r, v, nv, term, trunc, gamma, lam, boot_mask=torch.zeros_like(term), reset_mask=term | trunc)


def gae_no_trunc_bootstrap(r, v, nv, term, trunc, gamma, lam):
    done = term | trunc  # the CleanRL #198 / #457 bug: truncation treated as termination
    return _gae_loop(r, v, nv, term, trunc, gamma, lam, boot_mask=done, reset_mask=done)


def gae_across_boundaries(r, v, nv, term, trunc, gamma, lam):
    return _gae_loop(r, v, nv, term, trunc, gamma, lam, boot_mask=term, reset_mask=torch.zeros_like(term))


def gae_forward(r, v, nv, term, trunc, gamma, lam):
    return _gae_loop(r, v, nv, term, trunc, gamma, lam, boot_mask=term, reset_mask=term | trunc, forward=True)


def gae_reset_only_at_termination(r, v, nv, term, trunc, gamma, lam):
    return _gae_loop(r, v, nv, term, trunc, gamma, lam, boot_mask=term, reset_mask=term)


def gae_returns_are_advantages(r, v, nv, term, trunc, gamma, lam):
    deltas = r + gamma * nv * (~term).float() - v
    adv, running = torch.zeros_like(r), torch.zeros_like(r[0])
    for t in reversed(range(len(r))):
        running = deltas[t] + gamma * lam * (~(term[t] | trunc[t])).float() * running
        adv[t] = running
    return adv, adv  # forgets to add the values back: the value targets are advantages + values


def gae_float32_always(r, v, nv, term, trunc, gamma, lam):
    deltas = r + gamma * nv * (~term).float() - v
    adv, running = torch.zeros(r.shape), torch.zeros(r.shape[1:])  # float32 whatever the inputs' dtype
    for t in reversed(range(len(r))):
        running = deltas[t] + gamma * lam * (~(term[t] | trunc[t])).float() * running
        adv[t] = running
    return adv, adv + v


def gae_as_lambda_returns(r, v, nv, term, trunc, gamma, lam):
    """The textbook lambda-return recursion, G_t = r_t + gamma ((1 - lam) V' + lam G_{t+1}), restarted at every
    episode end; correct, and once rejected because the checker drew next_values unrelated to values."""
    done, boot = term | trunc, nv * (~term).float()
    returns, after = torch.zeros_like(r), torch.zeros_like(r[0])
    for t in reversed(range(len(r))):
        last = done[t] if t < len(r) - 1 else torch.ones_like(done[t])
        after = torch.where(last, r[t] + gamma * boot[t], r[t] + gamma * ((1 - lam) * nv[t] + lam * after))
        returns[t] = after
    return returns - v, returns


def gae_as_a_matrix(rewards, values, next_values, terminated, truncated, gamma, lam):
    """A vectorised form whose (gamma * lam) ** (k - t) is inf for k < t (0 ** -1, or an overflow on a long
    episode), masked by multiplying with 0: NaN. It passed when no case ran lam = 0 or a long episode."""
    T = rewards.shape[0]
    deltas = rewards + gamma * next_values * (~terminated) - values
    done = (terminated | truncated).to(rewards.dtype)
    episode = torch.cumsum(torch.cat([torch.zeros_like(done[:1]), done[:-1]]), 0)
    t = torch.arange(T, dtype=rewards.dtype)
    power = t[None, :] - t[:, None]
    weights = (gamma * lam) ** power * (power >= 0)
    advantages = torch.einsum("tkn,kn->tn", weights[:, :, None] * (episode[:, None] == episode[None, :]), deltas)
    return advantages, advantages + values


def gae_as_a_list(r, v, nv, term, trunc, gamma, lam):
    """[advantages, returns]: every caller unpacks it, and it was once rejected with "expected a tuple"."""
    return list(ch04.gae(r, v, nv, term, trunc, gamma, lam))


@pytest.mark.parametrize("fn", [gae, ch04.gae, gae_as_lambda_returns, gae_as_a_list])
def test_gae_checker_passes(fn):
    assert exercises.check_gae(fn, verbose=False).status == PASSED


@pytest.mark.parametrize(
    "buggy, message",
    [
        (gae_through_terminal, "bootstrap through a terminal state"),
        (gae_no_trunc_bootstrap, "did not bootstrap"),
        (gae_across_boundaries, "accumulates across episode boundaries"),
        (gae_forward, "runs forwards"),
        (gae_reset_only_at_termination, "runs across a truncation"),
        (gae_returns_are_advantages, "returns should be advantages + values"),
        (gae_float32_always, "expected dtype torch.float64"),
        (gae_float32_always, "build the result with torch.zeros_like(input)"),
        (gae_as_a_matrix, "lam = 0 (each advantage is its one-step TD error)': advantages: got NaN"),
    ],
)
def test_gae_checker_rejects(buggy, message):
    assert_rejected(exercises.check_gae, buggy, message)


def test_stubs_not_attempted():
    def stub(*args):
        raise NotImplementedError

    for check in (exercises.check_reinforce_loss, exercises.check_baseline_losses, exercises.check_gae):
        assert check(stub, verbose=False).status == NOT_ATTEMPTED
