"""Checkers for Chapter 5's exercises: the clip-case table (5.1), verified against autograd; the clipped
objective's values by hand (5.2); and PPO's whole update (5.3), run beside the library's on a fixed batch,
optimizer step by optimizer step."""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from edurl.envs import TorchCartPole
from edurl.exercises._core import (
    FAILED,
    NOT_ATTEMPTED,
    PASSED,
    REFERENCE_TAKES_OVER,
    Hints,
    Verdict,
    _where_it_raised,
    finish,
    with_hints,
)
from edurl.exercises.solutions import ch05 as _solutions
from edurl.objectives import clipped_surrogate
from edurl.rl.clip_explorer import clip_case
from edurl.rl.networks import CategoricalPolicy, ValueNet
from edurl.rl.ppo import PPOBatch, PPOConfig, collect_batch
from edurl.rl.ppo import ppo_update as _library_update

__all__ = [
    "check_clip_table",
    "check_clip_values",
    "check_ppo_update",
    "CLIP_TABLE_CASES",
    "CLIP_VALUE_CASES",
    "reference_clip_table",
    "reference_clip_values",
]

CLIP_EPS = 0.2
#: (advantage sign, ratio region) -> a ratio inside that region, used to ask autograd
CLIP_TABLE_CASES = {
    ("A > 0", "r < 1 - eps"): (1.0, 0.5),
    ("A > 0", "inside"): (1.0, 1.05),
    ("A > 0", "r > 1 + eps"): (1.0, 1.5),
    ("A < 0", "r < 1 - eps"): (-1.0, 0.5),
    ("A < 0", "inside"): (-1.0, 1.05),
    ("A < 0", "r > 1 + eps"): (-1.0, 1.5),
}


def reference_clip_table() -> dict:
    """The table computed from the training code's loss with autograd."""
    table = {}
    for key, (adv, ratio) in CLIP_TABLE_CASES.items():
        picks, zero = clip_case(ratio, adv, CLIP_EPS)
        table[key] = {"min picks": picks, "gradient is zero": zero}
    return table


_HINTS_CLIP_TABLE = Hints(
    idea=(
        "In each row, work out both terms of the min at the row's ratio and advantage, see which one is smaller, "
        "and ask whether that term still changes when r changes."
    ),
    formula=(
        "L(r) = min(r * A, clip(r, 1 - eps, 1 + eps) * A); min() takes the smaller value (also when both are "
        "negative), and d/dr clip(r) = 0 outside [1 - eps, 1 + eps]."
    ),
    solution=_solutions.clip_table,
)


@with_hints(_HINTS_CLIP_TABLE)
def check_clip_table(table, *, verbose: bool = True) -> Verdict:
    """Check a learner's clip-case table: for each (sign of A, ratio region), which term min() picks
    ("unclipped", "clipped", or "both" when they are equal) and whether the gradient is zero."""
    reference = reference_clip_table()
    return finish(_check(table, reference), _HINTS_CLIP_TABLE, verbose=verbose)


def _as_bool(x) -> bool | None:
    """True or False as written, or as autograd computes it (a one-element bool tensor, or numpy's bool); else None."""
    if isinstance(x, bool):
        return x
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool and x.numel() == 1:
        return bool(x)
    if type(x).__module__ == "numpy" and str(getattr(x, "dtype", "")) == "bool" and getattr(x, "size", 0) == 1:
        return bool(x.item())  # numpy's bool, or a one-element bool array (r.grad.numpy() == 0)
    return None


def _check(table, reference) -> Verdict:
    name = "Exercise 5.1 clip table"
    if not isinstance(table, dict):
        return Verdict(name, FAILED, f"expected a dict keyed by (sign, region), got {type(table).__name__}.", reference)
    cells = [table.get(key) for key in reference]
    if all(c is None or (isinstance(c, dict) and all(v is None for v in c.values())) for c in cells):
        return Verdict(name, NOT_ATTEMPTED, "Fill in the table (replace each None) and run this cell again.", reference)
    labels = ("unclipped", "clipped", "both")
    for key, expected in reference.items():
        got = table.get(key)
        if not isinstance(got, dict) or set(got) != set(expected):
            return Verdict(
                name,
                FAILED,
                f"row {key}: expected a dict with keys {sorted(expected)}, got {got!r}.",
                reference,
                case=str(key),
            )
        if any(v is None for v in got.values()):
            return Verdict(name, FAILED, f"row {key} is not filled in yet: {got!r}.", reference, case=str(key))
        picks = got["min picks"].strip().lower() if isinstance(got["min picks"], str) else got["min picks"]
        if picks not in labels:
            return Verdict(
                name,
                FAILED,
                f"row {key}: 'min picks' is {got['min picks']!r}; write one of {', '.join(map(repr, labels))}.",
                reference,
                case=str(key),
            )
        zero = _as_bool(got["gradient is zero"])
        if zero is None:
            return Verdict(
                name,
                FAILED,
                f"row {key}: 'gradient is zero' is {got['gradient is zero']!r}; write True or False.",
                reference,
                case=str(key),
            )
        adv, ratio = CLIP_TABLE_CASES[key]
        if picks != expected["min picks"]:
            if expected["min picks"] == "both":
                why = "are equal, so min() takes either: write 'both'."
            elif picks == "both":
                why = "are not equal, so 'both' is not right: min() takes one of them."
            else:
                why = (
                    "so min() takes the other one. Hint: min() takes the *smaller* (more pessimistic) value, also "
                    "when both are negative."
                )
            return Verdict(
                name,
                FAILED,
                f"row {key}: min picks {got['min picks']!r}, but at A = {adv:+.0f}, r = {ratio}, eps = "
                f"{CLIP_EPS}: r*A = {ratio * adv:.2f} and clip(r)*A = "
                f"{min(max(ratio, 1 - CLIP_EPS), 1 + CLIP_EPS) * adv:.2f} {why}",
                reference,
                case=str(key),
            )
        if zero != expected["gradient is zero"]:
            return Verdict(
                name,
                FAILED,
                f"row {key}: autograd says the gradient is {'zero' if expected['gradient is zero'] else 'not zero'}"
                f" there. Hint: the gradient is zero exactly when min() picks the clipped term, "
                "because clip(r) is constant outside [1 - eps, 1 + eps].",
                reference,
                case=str(key),
            )
    return Verdict(name, PASSED, "All six cells agree with autograd.", table)


# ---------------------------------------------------------------- 5.2 the clipped objective's values by hand

#: the (A, r) pairs of exercise 5.2, at eps = CLIP_EPS
CLIP_VALUE_CASES = ((2.0, 1.5), (2.0, 0.5), (-1.0, 0.5), (-1.0, 1.5), (1.0, 1.1))


def reference_clip_values() -> dict:
    """(A, r) -> (r * A, clip(r) * A, objective), the objective from the training code's loss."""
    table = {}
    for adv, ratio in CLIP_VALUE_CASES:
        objective = -clipped_surrogate(
            torch.tensor(math.log(ratio), dtype=torch.float64),
            torch.tensor(0.0, dtype=torch.float64),
            torch.tensor(adv, dtype=torch.float64),
            1 - CLIP_EPS,
            1 + CLIP_EPS,
        )
        clipped = min(max(ratio, 1 - CLIP_EPS), 1 + CLIP_EPS) * adv
        table[(adv, ratio)] = (round(ratio * adv, 10), round(clipped, 10), round(objective.item(), 10))
    return table


_HINTS_CLIP_VALUES = Hints(
    idea=(
        "Two numbers first: the plain weighted advantage, and the same with the ratio first held inside the "
        "trust region. The objective is then whichever of the two is worse for the policy."
    ),
    formula="unclipped = r * A; clipped = clamp(r, 1 - eps, 1 + eps) * A; objective = min(unclipped, clipped).",
    solution=_solutions.clip_values,
)


def _close(a, b) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and abs(a - b) <= 1e-6 + 1e-6 * abs(b)


def _number(x):
    """A one-element tensor, as computed with torch, or a numpy scalar is the number it holds; anything else is as
    given."""
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    if type(x).__module__ == "numpy" and hasattr(x, "item") and getattr(x, "shape", None) == ():
        return x.item()
    return x


@with_hints(_HINTS_CLIP_VALUES)
def check_clip_values(table, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``{(A, r): (r * A, clip(r) * A, objective)}`` for the pairs of ``CLIP_VALUE_CASES``."""
    reference = reference_clip_values()
    return finish(_check_values(table, reference), _HINTS_CLIP_VALUES, verbose=verbose)


def _check_values(table, reference) -> Verdict:
    name = "Exercise 5.2 clip values"
    if not isinstance(table, dict):
        return Verdict(name, FAILED, f"expected a dict keyed by (A, r), got {type(table).__name__}.", reference)
    rows = [table.get(key) for key in reference]
    if all(row is None or (isinstance(row, (tuple, list)) and all(v is None for v in row)) for row in rows):
        return Verdict(name, NOT_ATTEMPTED, "Fill in the three numbers of each row and run this cell again.", reference)
    for (adv, ratio), (unclipped, clipped, objective) in reference.items():
        got = table.get((adv, ratio))
        where = f"row A = {adv:+g}, r = {ratio:g}"
        if not (isinstance(got, (tuple, list)) and len(got) == 3):
            return Verdict(name, FAILED, f"{where}: expected a tuple of three numbers, got {got!r}.", reference)
        if any(x is None for x in got):
            return Verdict(name, FAILED, f"{where} is not filled in yet: {got!r}.", reference)
        g_unclipped, g_clipped, g_objective = (_number(x) for x in got)
        if not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in (g_unclipped, g_clipped, g_objective)
        ):
            return Verdict(
                name,
                FAILED,
                f"{where}: expected three numbers, got {got!r}; write each as a number (a float, or a one-element "
                "tensor), not a string or a tensor of several values.",
                reference,
            )
        if not _close(g_unclipped, unclipped):
            return Verdict(
                name,
                FAILED,
                f"{where}: the unclipped term is the ratio times the advantage; {g_unclipped!r} is not.",
                reference,
            )
        if not _close(g_clipped, clipped):
            why = ""
            if _close(g_clipped, min(max(ratio * adv, 1 - CLIP_EPS), 1 + CLIP_EPS)):
                why = " the likely mistake: you clipped the product r * A; the clip bounds the ratio alone."
            elif _close(g_clipped, unclipped):
                why = f" the likely mistake: r = {ratio:g} is outside [0.8, 1.2], so the clip changes it."
            return Verdict(name, FAILED, f"{where}: the clipped term is wrong ({g_clipped!r}).{why}", reference)
        if not _close(g_objective, objective):
            why = ""
            if _close(g_objective, max(unclipped, clipped)):
                why = " the likely mistake: you took the larger term; PPO takes the smaller, pessimistic one."
                if adv < 0:
                    why += " With A < 0 both terms are negative, and the smaller is the more negative."
            return Verdict(name, FAILED, f"{where}: the objective is wrong ({g_objective!r}).{why}", reference)
    return Verdict(name, PASSED, "All five rows agree with the training code's objective.", table)


# ---------------------------------------------------------------- 5.3 the whole PPO update

_UPDATE_CONFIG = PPOConfig(
    env_backend="torch",
    num_envs=8,
    num_steps=16,
    update_epochs=3,
    num_minibatches=4,
    vf_coef=0.25,  # not 0.5, so that a missing 1/2 and a missing vf_coef are told apart
    ent_coef=0.01,
    max_grad_norm=0.3,  # not the default, so that a hard-coded 0.5 shows
    progress=False,
)
_UPDATE_CLIP = 0.15  # not config.clip_eps (0.2): train_ppo passes an annealed clip, and the update must use it


class _RecordingOptimizer:
    """Wraps an optimizer; every ``step()`` records (a copy of) the gradients it is about to apply."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.inner = optimizer
        self.param_groups = optimizer.param_groups
        self.steps: list[list[torch.Tensor]] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        self.steps.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params])
        return self.inner.step(closure)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _fixed_batch():
    """A real batch: 8 TorchCartPole envs x 16 steps of a fresh policy, with GAE targets; returned in float64."""
    config = _UPDATE_CONFIG
    torch.manual_seed(5)
    device = torch.device("cpu")
    env = TorchCartPole(config.num_envs, device=device, check_actions=False)
    obs, _ = env.reset(seed=config.seed)
    policy, value = CategoricalPolicy(env.obs_dim, env.num_actions, (32,)), ValueNet(env.obs_dim, (32,))
    batch, *_ = collect_batch(env, policy, value, obs, config, device)
    # float64 from here on, so that a learner's different but equivalent order of operations cannot matter
    batch = PPOBatch(**{f.name: _double(getattr(batch, f.name)) for f in dataclasses.fields(batch)})
    return policy.double(), value.double(), batch


def _double(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


def _run_update(fn, policy, value, batch, config=_UPDATE_CONFIG, clip_eps=_UPDATE_CLIP):
    """Run an update from copies of the nets with a recording Adam; returns (policy, value, optimizer)."""
    policy, value = copy.deepcopy(policy), copy.deepcopy(value)
    # a large learning rate, so that ratios leave the clip range within a few steps and the clip matters
    adam = torch.optim.Adam([*policy.parameters(), *value.parameters()], lr=0.03, eps=1e-5)
    optimizer = _RecordingOptimizer(adam)
    torch.manual_seed(11)  # the same minibatch shuffles for everyone
    fn(policy, value, optimizer, batch, config, clip_eps)
    return policy, value, optimizer


def _same_step(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float = 1e-6) -> bool:
    return all(torch.allclose(x, y, rtol=rtol, atol=rtol * 1e-3) for x, y in zip(a, b))


_NEAR_MISS = 1e-3
"""Gradients this close to the reference's, and no known mistake's: something that barely moves the gradient here
differs (another eps in the standardisation; an entropy bonus of another size, whose gradient is small because the
check batch's policy is nearly uniform; a float32 cast). The message names these, without claiming which."""


def _steps_in_agreement(a, b) -> int:
    """How many leading optimizer steps of two runs applied the same gradients."""
    n = 0
    while n < min(len(a), len(b)) and _same_step(a[n], b[n]):
        n += 1
    return n


def _buggy_update(bug: str):
    """PPO's update with one realistic mistake, to recognise a learner's by its gradients."""

    def update(policy, value, optimizer, batch, config, clip_eps):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        fixed_order = list(batch.minibatches(config.num_minibatches)) if bug == "no reshuffle" else None
        for _ in range(1 if bug == "one epoch" else config.update_epochs):
            order = fixed_order if bug == "no reshuffle" else batch.minibatches(config.num_minibatches)
            for idx in order:
                lp, ent = policy.logprob_and_entropy(batch.obs[idx], batch.actions[idx])
                adv = batch.advantages if bug == "batch normalisation" else batch.advantages[idx]
                if bug != "no normalisation":
                    std = adv.std(unbiased=bug != "population std")
                    adv = (adv - adv.mean()) / (std + (1e-5 if bug == "adam eps" else 1e-8))
                if bug == "batch normalisation":
                    adv = adv[idx]
                old = lp.detach() if bug == "ratio to current" else batch.sampling_logprobs[idx]
                ratio = torch.exp(old - lp) if bug == "inverted ratio" else torch.exp(lp - old)
                eps = config.clip_eps if bug == "config clip" else clip_eps
                clipped = ratio.clamp(1 - eps, 1 + eps) * adv
                terms = {
                    "no clip": ratio * adv,
                    "clip only": clipped,
                    "max": torch.max(ratio * adv, clipped),
                    "min of ratios": torch.min(ratio, ratio.clamp(1 - eps, 1 + eps)) * adv,
                }.get(bug, torch.min(ratio * adv, clipped))
                err = (value(batch.obs[idx]) - batch.returns[idx]) ** 2
                value_loss = (err.mean() if bug == "no half" else 0.5 * err.mean()) * (
                    1.0 if bug == "no vf_coef" else config.vf_coef
                )
                bonus = 0.0 if bug == "no entropy" else config.ent_coef * ent.mean()
                loss = -terms.mean() + value_loss + (bonus if bug == "entropy sign" else -bonus)
                if bug != "no zero_grad":
                    optimizer.zero_grad()
                loss.backward()
                if bug == "policy grad clip":
                    torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
                elif bug == "grad clip per net":
                    torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
                    torch.nn.utils.clip_grad_norm_(value.parameters(), config.max_grad_norm)
                elif bug != "no grad clip":
                    torch.nn.utils.clip_grad_norm_(params, 0.5 if bug == "fixed grad clip" else config.max_grad_norm)
                optimizer.step()

    return update


_BUGS = {
    "no clip": "the objective is never clipped, so later steps keep pushing ratios that already left the trust "
    "region (the first step agrees: every ratio starts at 1).",
    "clip only": "only the clipped term is used. Take the pessimistic of the two terms, or a move that should be "
    "undone loses its gradient.",
    "max": "the optimistic (larger) of the two terms is taken; PPO takes the smaller one.",
    "ratio to current": "the ratio is taken against the current policy, so it is always 1 and the clip never binds. "
    "Divide by pi_old: the batch's sampling_logprobs.",
    "no normalisation": "the advantages are not standardised within each minibatch.",
    "batch normalisation": "the advantages are standardised over the whole batch; standardise each minibatch's own.",
    "population std": "the advantages are divided by the population std (unbiased=False, or numpy's np.std); the "
    "reference divides by torch's default, the sample std: (adv - adv.mean()) / (adv.std() + 1e-8).",
    "no zero_grad": "the gradients of earlier minibatches are added to this one's: zero them before backward().",
    "no grad clip": "the gradient norm is not clipped at config.max_grad_norm.",
    "policy grad clip": "only the policy's gradient is clipped; clip the norm of every parameter's gradient together "
    "(the policy's and the value net's), as one vector: clip_grad_norm_(params, config.max_grad_norm).",
    "grad clip per net": "the policy's and the value net's gradients are clipped each on its own; clip the norm of "
    "all of them together, as one vector: clip_grad_norm_(params, config.max_grad_norm).",
    "inverted ratio": "the ratio is upside down, pi_old / pi: it is exp(new log-prob - sampling log-prob).",
    "min of ratios": "the min is taken of the ratios, min(r, clip(r)) * A, before the advantage: with A < 0 that "
    "picks the wrong term. Take the min of the two products, min(r * A, clip(r) * A).",
    "fixed grad clip": "the gradient norm is clipped at 0.5, not at config.max_grad_norm.",
    "config clip": "the clip range is config.clip_eps, not the clip_eps argument: train_ppo passes an annealed "
    "one, which then never takes effect.",
    "no half": "the value loss is twice the reference's: it is half the mean squared error.",
    "no vf_coef": "the value loss is not weighted by config.vf_coef.",
    "entropy sign": "the entropy bonus has the wrong sign: more entropy should lower the loss.",
    "no entropy": "the entropy bonus is missing: subtract config.ent_coef times the minibatch's mean entropy.",
    "adam eps": "the standardisation adds 1e-5 to the std (Adam's eps in this chapter); it adds 1e-8.",
    "no reshuffle": "the minibatches come in the same order every epoch: draw them with "
    "batch.minibatches(config.num_minibatches) at the start of each epoch.",
}


_HINTS_PPO_UPDATE = Hints(
    idea=(
        "Reuse one batch several times. Each epoch, walk through freshly shuffled minibatches; on each, score the "
        "actions under the current policy, compare with the policy that collected them through the probability "
        "ratio, and take one clipped, gradient-norm-limited step on the policy, value and entropy terms together."
    ),
    formula=(
        "for each of config.update_epochs epochs: for idx in batch.minibatches(config.num_minibatches): "
        "lp, H = policy.logprob_and_entropy(obs[idx], actions[idx]); A = advantages[idx]; "
        "A = (A - A.mean()) / (A.std() + 1e-8); "
        "r = exp(lp - sampling_logprobs[idx]); L_pi = -mean(min(r A, clamp(r, 1 - eps, 1 + eps) A)); "
        "L_V = 0.5 mean((value(obs[idx]) - returns[idx])^2); loss = L_pi + vf_coef L_V - ent_coef mean(H); "
        "zero_grad, backward, clip_grad_norm_(all params, max_grad_norm), step."
    ),
    solution=_solutions.ppo_update,
)


@with_hints(_HINTS_PPO_UPDATE)
def check_ppo_update(fn, *, verbose: bool = True) -> Verdict:
    """Run a learner's ``ppo_update(policy, value, optimizer, batch, config, clip_eps)`` beside the library's on
    one fixed CartPole batch (3 epochs x 4 minibatches, float64) and compare every optimizer step's gradients
    and the final weights; the first step that differs is named, with the likely mistake."""
    with torch.random.fork_rng(devices=[]):  # it seeds torch; the learner's random stream goes on as it was
        verdict = _check_update(fn)
    return finish(verdict, _HINTS_PPO_UPDATE, verbose=verbose, on_failure=REFERENCE_TAKES_OVER)


_ONE_MINIBATCH = dataclasses.replace(_UPDATE_CONFIG, num_minibatches=1, update_epochs=2)
"""train_ppo's default: one minibatch, for which batch.minibatches(1) yields slice(None), not a tensor of indices."""


def _check_one_minibatch(fn, policy, value, batch) -> str | None:
    """What goes wrong with one minibatch (``config.num_minibatches=1``, train_ppo's default), or None."""
    _, _, ref = _run_update(_library_update, policy, value, batch, config=_ONE_MINIBATCH)
    where = "with config.num_minibatches=1 (train_ppo's default; the check so far used 4)"
    try:
        _, _, got = _run_update(fn, policy, value, batch, config=_ONE_MINIBATCH)
    except Exception as err:  # a learner's bug is reported, never re-raised
        return (
            f"{where}, your function raised {type(err).__name__}{_where_it_raised(err)}: {err}\n  the likely "
            "mistake: batch.minibatches(1) yields slice(None), the whole batch, not a tensor of indices. Index with "
            "it as with any idx, and count a minibatch's samples from a tensor it indexed (batch.advantages[idx]"
            ".numel()), not with len(idx); or take .mean()."
        )
    if len(got.steps) != len(ref.steps):
        return (
            f"{where}: your update took {len(got.steps)} optimizer steps, expected {len(ref.steps)} "
            f"({_ONE_MINIBATCH.update_epochs} epochs x 1 minibatch). batch.minibatches(1) yields slice(None), the "
            "whole batch, once per epoch."
        )
    agreed = _steps_in_agreement(got.steps, ref.steps)
    if agreed < len(ref.steps):
        return (
            f"{where}: optimizer step {agreed + 1} of {len(ref.steps)} applied other gradients than the reference's. "
            "batch.minibatches(1) yields slice(None): the minibatch is the whole batch, indexed as any other."
        )
    return None


def _check_update(fn) -> Verdict:
    name = "Exercise 5.3 ppo_update"
    if not callable(fn):
        return Verdict(name, FAILED, f"expected a function, got {type(fn).__name__}.", _library_update)
    policy, value, batch = _fixed_batch()
    config = _UPDATE_CONFIG
    ref_policy, ref_value, ref = _run_update(_library_update, policy, value, batch)
    try:
        new_policy, new_value, got = _run_update(fn, policy, value, batch)
    except NotImplementedError:
        return Verdict(
            name,
            NOT_ATTEMPTED,
            "Your function still raises NotImplementedError. Fill in the body and run this cell again; until "
            "then the notebook uses the reference update.",
            _library_update,
        )
    except Exception as err:  # a learner's bug is reported, never re-raised
        return Verdict(
            name, FAILED, f"your function raised {type(err).__name__}{_where_it_raised(err)}: {err}", _library_update
        )
    expected_steps = config.update_epochs * config.num_minibatches
    if not got.steps:
        before = [*policy.parameters(), *value.parameters()]
        if _same_step([*new_policy.parameters(), *new_value.parameters()], before):
            text = "the weights were never updated: take one optimizer step per minibatch."
        else:
            text = (
                "the weights changed, but the optimizer passed to your function never took a step: use the optimizer "
                "you were given, not one of your own. train_ppo makes one Adam for the whole run, and its running "
                "averages of the gradients carry over from one update to the next."
            )
        return Verdict(name, FAILED, text, _library_update)
    agreed = _steps_in_agreement(got.steps, ref.steps)
    first_bad = agreed if agreed < min(len(got.steps), len(ref.steps)) else None
    if first_bad is None and len(got.steps) != expected_steps:
        why = ""
        if len(got.steps) == config.num_minibatches:
            why = (
                " the likely mistake: one pass over the batch; PPO makes config.update_epochs passes. Or the "
                "minibatches were drawn once, before the epochs: batch.minibatches(...) is a generator, used up after "
                "one epoch, so call it inside the epoch loop."
            )
        return Verdict(
            name,
            FAILED,
            f"took {len(got.steps)} optimizer steps, expected {expected_steps} ({config.update_epochs} epochs x "
            f"{config.num_minibatches} minibatches).{why}",
            _library_update,
        )
    if first_bad is not None:
        epoch, minibatch = divmod(first_bad, config.num_minibatches)
        text = (
            f"optimizer step {first_bad + 1} of {expected_steps} (epoch {epoch + 1}, minibatch {minibatch + 1}): the "
            "gradients differ from the reference's on the same batch"
            + (", after earlier steps that matched." if first_bad else ".")
        )
        # the known mistake that agrees with the learner's steps the longest (at least past the first bad one)
        agree = {
            bug: _steps_in_agreement(got.steps, _run_update(_buggy_update(bug), policy, value, batch)[2].steps)
            for bug in _BUGS
        }
        best = max(agree, key=agree.get)
        if agree[best] > first_bad:
            text += f"\n  the likely mistake: {_BUGS[best]}"
        elif _same_step(got.steps[first_bad], ref.steps[first_bad], rtol=_NEAR_MISS):
            text += (
                f"\n  they differ by less than {_NEAR_MISS:.1%}: look at what moves the gradient very little here. "
                "The entropy bonus, - config.ent_coef * mean entropy (this batch's policy is nearly uniform); the "
                "1e-8 in (adv - adv.mean()) / (adv.std() + 1e-8); and a cast to float32 (the check runs in float64)."
            )
        return Verdict(name, FAILED, text, _library_update)
    got_w = [*new_policy.parameters(), *new_value.parameters()]
    ref_w = [*ref_policy.parameters(), *ref_value.parameters()]
    one = _check_one_minibatch(fn, policy, value, batch)
    if one is not None:
        return Verdict(name, FAILED, one, _library_update)
    if not _same_step(got_w, ref_w):
        text = "every step's gradients match, but the final weights differ: "
        if _same_step(got_w, ref_w, rtol=_NEAR_MISS):  # e.g. a ratio rounded through float32: each step a hair off
            text += (
                f"by less than {_NEAR_MISS:.1%}, as when a value is cast to float32 somewhere (the check runs in "
                "float64, and each step's rounding stays inside its gradient tolerance). Otherwise, "
            )
        return Verdict(name, FAILED, text + "change the weights only through the optimizer's steps.", _library_update)
    return Verdict(
        name,
        PASSED,
        f"all {expected_steps} optimizer steps match the reference's gradients, and the final weights match. "
        "The notebook now trains PPO with your update.",
        fn,
    )
