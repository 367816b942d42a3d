"""Checkers for Chapter 2's exercises: the REINFORCE loss with return normalisation (2.1), and the whole
REINFORCE update (2.2), run beside the library's for a few updates from the same seed."""

from __future__ import annotations

import copy
import numbers

import gymnasium as gym
import torch

from edurl.exercises._core import (
    FAILED,
    NOT_ATTEMPTED,
    PASSED,
    REFERENCE_TAKES_OVER,
    Case,
    Diagnosis,
    Hints,
    Verdict,
    _where_it_raised,
    compare_outputs,
    finish,
    format_value,
    run_checker,
    with_hints,
)
from edurl.exercises._grad import with_gradients
from edurl.exercises.solutions import ch02 as _solutions
from edurl.rl.networks import CategoricalPolicy
from edurl.rl.reinforce import ReinforceConfig
from edurl.rl.reinforce import reinforce_loss as _library_loss
from edurl.rl.reinforce import reinforce_update as _library_update
from edurl.rl.returns import discounted_returns

__all__ = ["check_reinforce_loss", "check_reinforce_update"]


def _reference(logprobs, returns):
    return _library_loss(logprobs, returns, normalize_advantages=True)


def _standardised(returns):
    return (returns - returns.mean()) / (returns.std() + 1e-8)


# Each mistake below keeps the returns in the graph, as a learner who forgot to detach them would; the diagnoses
# also try each one on detached returns (_detached), the same mistake made by a learner who remembered.


def _no_minus(logprobs, returns):
    return (logprobs * _standardised(returns)).mean()


def _not_normalised(logprobs, returns):
    return -(logprobs * returns).mean()


def _centred_only(logprobs, returns):
    return -(logprobs * (returns - returns.mean())).mean()


def _population_std(logprobs, returns):
    return -(logprobs * (returns - returns.mean()) / (returns.std(unbiased=False) + 1e-8)).mean()


def _no_epsilon(logprobs, returns):
    return -(logprobs * (returns - returns.mean()) / returns.std()).mean()


def _summed(logprobs, returns):
    return -(logprobs * _standardised(returns)).sum()


def _returns_not_detached(logprobs, returns):
    return -(logprobs * _standardised(returns)).mean()


def _probabilities(logprobs, returns):
    return -(logprobs.exp() * _standardised(returns)).mean()


def _detached(buggy):
    """A mistake made by a learner who did detach the returns (the check differentiates through them too)."""
    return lambda logprobs, returns: buggy(logprobs, returns.detach())


_MISTAKES = [
    (
        _no_minus,
        "the sign is flipped. Optimisers minimise, and we want to *increase* sum log pi * G: return the negative.",
    ),
    (_not_normalised, "the returns are not normalised: use (G - G.mean()) / (G.std() + 1e-8)."),
    (_centred_only, "you subtracted the mean but did not divide by the std (+ 1e-8)."),
    (_population_std, "use torch's default returns.std() (the unbiased one), not std(unbiased=False)."),
    (_no_epsilon, "when every return is equal, the std is 0 and you divide by zero: add 1e-8 to the std."),
    (_summed, "take the mean over steps, not the sum: the loss should not grow with the batch size."),
    (_probabilities, "use the log-probabilities as given; the gradient estimator needs grad log pi, not grad pi."),
]
_DIAGNOSES = [
    Diagnosis(
        _returns_not_detached,
        "the loss sends a gradient into the returns. They are the data the policy is judged by, not something to "
        "train: detach them (returns.detach()) before you use them.",
    ),
    *(Diagnosis(_detached(mistake), hint) for mistake, hint in _MISTAKES),  # made by a learner who did detach
    *(  # and by one who did not
        Diagnosis(mistake, f"{hint} Detach the returns too: no gradient may flow into them.")
        for mistake, hint in _MISTAKES
    ),
]


def _cases() -> list[Case]:
    g = torch.Generator().manual_seed(2)
    cases = [
        Case("three steps", dict(logprobs=torch.tensor([-0.5, -1.0, -2.0]), returns=torch.tensor([1.0, 2.0, 3.0]))),
        Case(
            "returns all equal (std = 0)", dict(logprobs=torch.tensor([-0.3, -0.9]), returns=torch.tensor([5.0, 5.0]))
        ),
        Case(
            "negative returns",
            dict(logprobs=torch.tensor([-0.1, -0.7, -0.2, -1.5]), returns=torch.tensor([-3.0, 1.0, -0.5, 0.0])),
        ),
    ]
    for n in (10, 200):
        cases.append(
            Case(
                f"random batch of {n}",
                dict(logprobs=-torch.rand(n, generator=g) * 3, returns=torch.randn(n, generator=g) * 20 + 40),
            )
        )
    return cases


_HINTS_REINFORCE_LOSS = Hints(
    idea=(
        "Push up the log-probability of each action in proportion to how good its return was compared with "
        "the rest of the batch. Standardise the returns so the step size does not depend on their scale, keep"
        " them out of the gradient, and remember that an optimiser minimises."
    ),
    formula="loss = -mean(logprobs * (G - G.mean()) / (G.std() + 1e-8)), with no gradient through the returns.",
    solution=_solutions.reinforce_loss,
)


@with_hints(_HINTS_REINFORCE_LOSS)
def check_reinforce_loss(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``reinforce_loss(logprobs, returns)``: its value and its gradients (none through the
    returns)."""
    return run_checker(
        "Exercise 2.1 reinforce_loss",
        fn,
        _reference,
        _cases(),
        diagnoses=_DIAGNOSES,
        wrap=with_gradients(["loss"], [("loss", 0), ("loss", 1)]),
        compare=compare_outputs(["loss", "d loss / d logprobs", "d loss / d returns"], rtol=1e-4, atol=1e-6),
        verbose=verbose,
        hints=_HINTS_REINFORCE_LOSS,
    )


# ---------------------------------------------------------------- 2.2 the whole update

_UPDATES, _ENVS, _GAMMA = 3, 4, 0.97
_DEFAULT_GAMMA = ReinforceConfig.gamma
"""train_reinforce's gamma; the check passes another (_GAMMA), so that a gamma written into the update is caught."""


def _update_losses(policy, batch, gamma: float) -> dict[str, float]:
    """The losses that common mistakes compute from the same episodes, with the pre-update ``policy``."""
    returns = discounted_returns(batch.rewards, batch.dones, gamma)  # (T, N)
    m = batch.mask
    with torch.no_grad():
        logprobs_all = policy(batch.obs.flatten(0, 1)).log_prob(batch.actions.flatten()).view_as(returns)
    lp, G = logprobs_all[m], returns[m]
    totals = batch.rewards.sum(0, keepdim=True).expand_as(returns)  # each episode's whole return, at every step
    undiscounted = discounted_returns(batch.rewards, batch.dones, 1.0)
    return {
        "every step is weighted by its episode's *whole* return. Use the reward-to-go G_t from "
        "discounted_returns: an action cannot change the rewards that came before it.": float(
            _reference(lp, totals[m])
        ),
        "the returns are not discounted: pass gamma to discounted_returns.": float(_reference(lp, undiscounted[m])),
        "every step is weighted by its own reward r_t, not by the reward-to-go G_t (on CartPole every reward is 1, "
        "so once standardised they weigh nothing): pass the rewards through discounted_returns.": float(
            _reference(lp, batch.rewards[m])
        ),
        f"the returns are discounted with gamma={_DEFAULT_GAMMA}, not with the gamma passed to your function "
        f"(the check passes {gamma}): use the argument, so that a run with another gamma gets it.": float(
            _reference(lp, discounted_returns(batch.rewards, batch.dones, _DEFAULT_GAMMA)[m])
        ),
        "the padded steps after each episode's end are in the loss: keep only batch.mask's steps.": float(
            _reference(logprobs_all.flatten(), returns.flatten())
        ),
        "the sign is flipped: the loss is the *negative* of mean(log pi * G-hat).": float(-_reference(lp, G)),
        "the returns are not normalised: the loss of exercise 2.1 standardises them.": float(
            _library_loss(lp, G, normalize_advantages=False)
        ),
    }


def _one_number(loss) -> float | None:
    """The loss an update returned as a float, as ``train_reinforce`` logs it: a one-element tensor or a Python
    number; None for anything else (None itself, a tuple, a per-step vector)."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach())
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return float(loss)
    return None


def _describe(loss) -> str:
    if loss is None:
        return "None (a missing return?)"
    if isinstance(loss, torch.Tensor):
        return (
            f"a tensor of shape {tuple(loss.shape)}: return the mean you called backward() on, not the per-step terms"
        )
    return f"{type(loss).__name__} {format_value(loss)}"


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * abs(b) + 1e-7


def _params(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.parameters()]


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    policy = CategoricalPolicy(4, 2, (16,))
    # a policy far from uniform, so that losses built from different weights differ clearly
    torch.nn.init.orthogonal_(policy.net[-1].weight, gain=2.0)
    return policy, torch.optim.Adam(policy.parameters(), lr=0.01), [gym.make("CartPole-v1") for _ in range(_ENVS)]


def _seeds(k: int) -> list[int]:
    """The env seeds of update ``k``."""
    return [100 * k + i for i in range(_ENVS)]


class _NoZeroGrad:
    """An optimizer whose ``zero_grad()`` does nothing, for the update that forgets to zero the gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.inner = optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _params_without_zero_grad(updates: int) -> list[torch.Tensor]:
    """The parameters after ``updates`` updates of the library's update, from the check's start, with the gradients
    never zeroed: the realistic mistake, replayed to recognise it by its parameters."""
    policy, optimizer, envs = _setup()
    for k in range(updates):
        torch.manual_seed(1000 + k)
        _library_update(policy, _NoZeroGrad(optimizer), envs, _seeds(k), _GAMMA, torch.device("cpu"))
    return _params(policy)


def _same_params(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(a, b))


_HINTS_REINFORCE_UPDATE = Hints(
    idea=(
        "Four steps, each one a function you have already met: play one fresh episode per env with the current "
        "policy, compute every step's reward-to-go, form exercise 2.1's loss on the real (unpadded) steps only, "
        "and take one optimizer step on it."
    ),
    formula=(
        "batch = collect_episodes(envs, policy.act, device, seeds=seeds); G = discounted_returns(batch.rewards, "
        "batch.dones, gamma); keep the steps where batch.mask is True; loss = reinforce_loss(log pi(a_t | s_t), "
        "G_t); zero the gradients, backward, step; return (batch, loss)."
    ),
    solution=_solutions.reinforce_update,
)


@with_hints(_HINTS_REINFORCE_UPDATE)
def check_reinforce_update(fn, *, verbose: bool = True) -> Verdict:
    """Run a learner's ``reinforce_update(policy, optimizer, envs, seeds, gamma, device) -> (batch, loss)`` beside
    the library's for three updates from the same seed and weights, and compare, after each update, the
    episodes, the loss and the parameters; the first that differs is named."""
    with torch.random.fork_rng(devices=[]):  # it seeds torch; the learner's random stream goes on as it was
        verdict = _check_update(fn)
    return finish(verdict, _HINTS_REINFORCE_UPDATE, verbose=verbose, on_failure=REFERENCE_TAKES_OVER)


def _check_update(fn) -> Verdict:
    name = "Exercise 2.2 reinforce_update"
    if not callable(fn):
        return Verdict(name, FAILED, f"expected a function, got {type(fn).__name__}.", _library_update)
    device = torch.device("cpu")
    ref_policy, ref_opt, ref_envs = _setup()
    policy, opt, envs = _setup()
    for k in range(_UPDATES):
        seeds = _seeds(k)
        before = copy.deepcopy(ref_policy)
        start = _params(policy)
        torch.manual_seed(1000 + k)  # the same sampling noise for both
        ref_batch, ref_loss = _library_update(ref_policy, ref_opt, ref_envs, seeds, _GAMMA, device)
        torch.manual_seed(1000 + k)
        where = f"Update {k + 1} of {_UPDATES}"
        try:
            out = fn(policy, opt, envs, seeds, _GAMMA, device)
        except NotImplementedError as err:
            if k == 0:
                return Verdict(
                    name,
                    NOT_ATTEMPTED,
                    "Your function still raises NotImplementedError. Fill in the body and run this cell again; "
                    "until then the notebook uses the reference update.",
                    _library_update,
                )
            return Verdict(
                name, FAILED, f"{where}: raised NotImplementedError{_where_it_raised(err)}.", _library_update
            )
        except Exception as err:  # a learner's bug is reported, never re-raised
            return Verdict(
                name,
                FAILED,
                f"{where}: your function raised {type(err).__name__}{_where_it_raised(err)}: {err}",
                _library_update,
            )
        if not (isinstance(out, (tuple, list)) and len(out) == 2):  # train_reinforce unpacks either
            got = type(out).__name__ + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
            return Verdict(name, FAILED, f"{where}: expected (batch, loss), got {got}.", _library_update)
        batch, loss = out
        if not hasattr(batch, "obs") or not hasattr(batch, "mask"):
            return Verdict(
                name,
                FAILED,
                f"{where}: the first thing returned should be the EpisodeBatch from collect_episodes, got "
                f"{type(batch).__name__}.",
                _library_update,
            )
        if batch.obs.shape != ref_batch.obs.shape or not torch.equal(batch.obs, ref_batch.obs):
            return Verdict(
                name,
                FAILED,
                f"{where}: the episodes differ from the reference's (observations of shape "
                f"{tuple(batch.obs.shape)}, expected {tuple(ref_batch.obs.shape)} with the same values). Play one "
                "episode per env with the policy's sampled actions, resetting env i with seeds[i].",
                _library_update,
            )
        expected, got = float(ref_loss.detach()), _one_number(loss)
        if got is None:
            return Verdict(
                name,
                FAILED,
                f"{where}: the loss returned should be one number, the loss you called backward() on, got "
                f"{_describe(loss)}.",
                _library_update,
            )
        if not _close(got, expected):
            mistake = next(
                (m for m, v in _update_losses(before, ref_batch, _GAMMA).items() if _close(got, v)),
                None,
            )
            text = f"{where}: on the same episodes your loss is {got:.6g}, the reference's {expected:.6g}."
            if mistake:
                text += f"\n  the likely mistake: {mistake}"
            return Verdict(name, FAILED, text, _library_update)
        now = _params(policy)
        if all(torch.equal(a, b) for a, b in zip(now, start)):
            return Verdict(
                name,
                FAILED,
                f"{where}: the loss is right but the parameters did not change. Zero the gradients, fill them with "
                "backward(), and take the optimizer's step last: a step taken before backward() or after the "
                "zeroing finds no gradient and changes nothing (and without a step nothing changes either).",
                _library_update,
            )
        if not _same_params(now, _params(ref_policy)):
            if k > 0 and _same_params(now, _params_without_zero_grad(k + 1)):
                why = "the gradients of the earlier updates were added to this one's: zero them before backward()."
            elif not opt.state:  # Adam keeps a state per parameter once it has stepped
                why = (
                    "the parameters changed, but the optimizer passed to your function never took a step: use the "
                    "optimizer you were given, not a new one. A new Adam takes the same first step, but loses the "
                    "running averages of the gradients that the given one carries from one update to the next."
                )
            else:
                why = "one update is one step of the given optimizer on this loss's gradient alone."
            return Verdict(
                name,
                FAILED,
                f"{where}: the loss is right but the parameters after the step differ from the reference's.\n"
                f"  the likely mistake: {why}",
                _library_update,
            )
    return Verdict(
        name,
        PASSED,
        f"{_UPDATES} updates match the reference: episodes, loss and parameters. The notebook now trains with "
        "your update.",
        fn,
    )
