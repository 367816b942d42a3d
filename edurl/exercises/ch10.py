"""Checkers for Chapter 10's exercises: the truncated importance weight of a stale batch (10.1) and DRO's soft
advantage (10.2), each compared with the library's in ``edurl.llm.losses``, and a whole offline DRO step (10.3),
run beside :func:`edurl.llm.offline.offline_step`."""

from __future__ import annotations

import copy
import math
from dataclasses import fields, replace

import torch

from edurl.exercises._core import (
    Case,
    Diagnosis,
    Hints,
    Verdict,
    compare_tensors,
    finish,
    run_checker,
    with_hints,
)
from edurl.exercises._grad import call_on_leaves, refuse_overwrite
from edurl.exercises.solutions import ch10 as _solutions
from edurl.llm.losses import soft_advantages as _library_soft
from edurl.llm.losses import truncated_importance_weights as _library_tis

__all__ = ["check_offline_step", "check_soft_advantages", "check_truncated_importance_weights"]


# ================================================================ 10.1 truncated_importance_weights


def _masked(weights, mask):
    return torch.where(mask != 0, weights, torch.zeros_like(weights))


def _inverted(train_logprobs, sampling_logprobs, mask, cap):
    return _library_tis(sampling_logprobs, train_logprobs, mask, cap)


def _untruncated(train_logprobs, sampling_logprobs, mask, cap):
    return _masked(torch.exp(train_logprobs - sampling_logprobs).detach(), mask)


def _two_sided(train_logprobs, sampling_logprobs, mask, cap):
    return _masked(torch.exp(train_logprobs - sampling_logprobs).detach().clamp(1 / cap, cap), mask)


def _ppo_range(train_logprobs, sampling_logprobs, mask, cap):
    return _masked(torch.exp(train_logprobs - sampling_logprobs).detach().clamp(0.8, 1.2), mask)


def _no_exp(train_logprobs, sampling_logprobs, mask, cap):
    return _masked((train_logprobs - sampling_logprobs).detach().clamp(max=cap), mask)


def _capped_log_ratio(train_logprobs, sampling_logprobs, mask, cap):
    return _masked(torch.exp((train_logprobs - sampling_logprobs).detach().clamp(max=cap)), mask)


def _unmasked(train_logprobs, sampling_logprobs, mask, cap):
    return torch.exp(train_logprobs - sampling_logprobs).detach().clamp(max=cap)


def _mask_in_exp(train_logprobs, sampling_logprobs, mask, cap):
    return torch.exp((train_logprobs - sampling_logprobs).detach() * mask).clamp(max=cap)


def _sequence_ratio(train_logprobs, sampling_logprobs, mask, cap):
    log_ratio = ((train_logprobs - sampling_logprobs) * (mask != 0)).sum(dim=1, keepdim=True).detach()
    return _masked(torch.exp(log_ratio).clamp(max=cap).expand_as(train_logprobs).clone(), mask)


_TIS_DIAGNOSES = [
    Diagnosis(
        _inverted,
        "the ratio is upside down: it is the trainer's probability over the sampler's, pi / q = exp(log pi - log q). "
        "A token the trainer now likes more than the sampler did gets a weight above 1.",
    ),
    Diagnosis(
        _untruncated,
        "the weights are not truncated: a token the sampler found unlikely can get a ratio of 100 or more and swamp "
        "the batch. Cap each weight at `cap`.",
    ),
    Diagnosis(
        _two_sided,
        "you clipped the ratio from below as well. Truncation caps only large weights; a small ratio means the "
        "trainer would rarely sample that token now, and it keeps its small weight.",
    ),
    Diagnosis(
        _ppo_range,
        "you used PPO's range [0.8, 1.2] instead of `cap`: truncation is one-sided, min(ratio, cap), and the "
        "ratio keeps its value below the cap.",
    ),
    Diagnosis(
        _no_exp,
        "the weight is the log-ratio itself: exponentiate the difference of log-probs to get the ratio of "
        "probabilities.",
    ),
    Diagnosis(
        _capped_log_ratio,
        "you capped the log-ratio at `cap` before exponentiating, which caps the ratio at e^cap. Cap the ratio.",
    ),
    Diagnosis(
        _unmasked,
        "the prompt and padding positions got weights: only the sampled tokens (mask 1) have a sampler log-prob "
        "to correct for. Give every other position 0.",
    ),
    Diagnosis(
        _mask_in_exp,
        "the positions off the mask got a weight of 1: a log-ratio multiplied by a mask of 0 is 0, and exp(0) = 1. "
        "Apply the mask to the weights, after the exp.",
    ),
    Diagnosis(
        _sequence_ratio,
        "you used one ratio per sequence (from the sum, or the mean, of its tokens' log-ratios). This exercise "
        "weights each token by its own ratio; a sequence's product of 20 ratios is almost always far outside the cap.",
    ),
]


def _tis_case(name: str, g, B: int, T: int, drift: float, cap: float, dtype=torch.float32) -> Case:
    """Random log-probs, the trainer's ``drift`` away from the sampler's, prompts and padding masked out."""
    sampling = -torch.rand(B, T, generator=g, dtype=dtype) * 4
    mask = torch.zeros(B, T, dtype=dtype)
    for b in range(B):
        start = int(torch.randint(1, T // 2, (1,), generator=g))
        mask[b, start : start + int(torch.randint(1, T - start + 1, (1,), generator=g))] = 1
    train = sampling + torch.randn(B, T, generator=g, dtype=dtype) * drift
    return Case(name, dict(train_logprobs=train, sampling_logprobs=sampling, mask=mask, cap=cap))


def _tis_cases() -> list[Case]:
    g = torch.Generator().manual_seed(101)
    return [
        Case(
            "worked example: log-ratios [0, log 3, -log 2, 3] on the reply, cap 2 -> [1, 2, 0.5, 2]; the prompt's -> 0",
            dict(
                train_logprobs=torch.tensor([[-0.5, -1.0, -2.0 + math.log(3), -3.0 - math.log(2), -1.0]]),
                sampling_logprobs=torch.tensor([[-1.5, -1.0, -2.0, -3.0, -4.0]]),
                mask=torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]]),
                cap=2.0,
            ),
        ),
        _tis_case("4 sequences x 12 positions, one step stale (drift 0.3), cap 2", g, 4, 12, 0.3, 2.0),
        _tis_case("8 sequences x 20 positions, eight steps stale (drift 1.5), cap 5", g, 8, 20, 1.5, 5.0),
        _tis_case("float64, drift 1.0, cap 1.5", g, 3, 10, 1.0, 1.5, torch.float64),
    ]


_HINTS_TIS = Hints(
    idea=(
        "A stale batch was sampled by older weights. Weighting each sampled token by how much more (or less) likely "
        "the current policy makes it turns the old samples into an estimate for the current policy, but one token "
        "the sampler found unlikely can get a huge weight; capping the weight from above keeps the variance "
        "bounded. The weight multiplies a gradient and gets none itself."
    ),
    formula="weights = min(exp(train_logprobs - sampling_logprobs), cap) where mask is 1, else 0; computed from "
    "detached log-probs.",
    solution=_solutions.truncated_importance_weights,
)


@with_hints(_HINTS_TIS)
def check_truncated_importance_weights(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``truncated_importance_weights(train_logprobs, sampling_logprobs, mask, cap)``: (B, T)
    log-probs and mask -> (B, T) weights, without gradient."""

    def compare(got, expected):
        problem = compare_tensors(got, expected, rtol=1e-5, atol=1e-6)
        if problem is None and got.requires_grad:
            return (
                "the weights carry a gradient: the weight scales the policy gradient but is not trained itself; "
                "compute it from detached log-probs (.detach())."
            )
        return problem

    def with_grad(f):
        def call(train_logprobs, sampling_logprobs, mask, cap):
            given = train_logprobs.clone().requires_grad_(True)
            out = call_on_leaves(f, given, sampling_logprobs, mask, cap)
            refuse_overwrite("train_logprobs", given, train_logprobs)
            return out

        return call

    return run_checker(
        "Exercise 10.1 truncated_importance_weights",
        fn,
        _library_tis,
        _tis_cases(),
        diagnoses=_TIS_DIAGNOSES,
        compare=compare,
        wrap=with_grad,
        verbose=verbose,
        hints=_HINTS_TIS,
    )


# ================================================================ 10.2 soft_advantages


def _mean_baseline(rewards, tau):
    return rewards - rewards.mean(dim=1, keepdim=True)


def _max_baseline(rewards, tau):
    return rewards - rewards.max(dim=1, keepdim=True).values


def _sum_not_mean(rewards, tau):
    return rewards - tau * torch.logsumexp(rewards / tau, dim=1, keepdim=True)


def _tau_missing_outside(rewards, tau):
    return rewards - (torch.logsumexp(rewards / tau, dim=1, keepdim=True) - math.log(rewards.shape[1]))


def _tau_multiplied(rewards, tau):
    return rewards - torch.log(torch.exp(rewards * tau).mean(dim=1, keepdim=True)) / tau


def _whole_batch(rewards, tau):
    return rewards - tau * (torch.logsumexp(rewards.flatten() / tau, dim=0) - math.log(rewards.numel()))


def _naive_exp(rewards, tau):
    return rewards - tau * torch.log(torch.exp(rewards / tau).mean(dim=1, keepdim=True))


_SOFT_DIAGNOSES = [
    Diagnosis(
        _mean_baseline,
        "you subtracted the group mean: that is GRPO's advantage, the limit of a very large tau. DRO's baseline is "
        "a soft maximum that leans toward the group's best rewards as tau gets small.",
    ),
    Diagnosis(
        _max_baseline,
        "you subtracted the group's maximum: that is the limit tau -> 0. For tau > 0 the baseline is the soft "
        "maximum, tau times the log of the mean of exp(R / tau), which lies between the mean and the maximum.",
    ),
    Diagnosis(
        _sum_not_mean,
        "the baseline uses the log of a sum over the group, not of a mean: it is too high by tau * log G, so "
        "every advantage is pushed down by the group size. (In this case, of two rewards, a sum divided by G - 1 "
        "looks the same: a mean divides by G. So does one divided by rewards.shape[0] or len(rewards), the number "
        "of groups, 1 here: G is rewards.shape[1].)",
    ),
    Diagnosis(
        _tau_missing_outside,
        "tau is missing outside the log: the soft maximum is tau * log mean exp(R / tau), in the rewards' units.",
    ),
    Diagnosis(
        _tau_multiplied,
        "tau is used the other way round: the rewards are divided by tau inside the exp, and the log is multiplied "
        "by tau outside it.",
    ),
    Diagnosis(
        _whole_batch,
        "the soft maximum is taken over the whole batch; take it over each group (each row), as GRPO's mean is.",
    ),
    Diagnosis(
        _naive_exp,
        "the result overflows for a small tau: exp(R / tau) is inf in float32 once R / tau passes about 88. Take "
        "each group's largest value out of the exp before the mean, and add it back after the log.",
    ),
]


def _soft_cases() -> list[Case]:
    g = torch.Generator().manual_seed(102)
    verifier = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [-0.1, 0.0, 1.0, -0.1]])
    return [
        Case(
            "worked example: rewards [[1, 0]], tau 1 -> [[0.380, -0.620]]",
            dict(rewards=torch.tensor([[1.0, 0.0]]), tau=1.0),
        ),
        Case("verifier rewards (1, 0, -0.1), groups of 4, tau 0.5", dict(rewards=verifier, tau=0.5)),
        Case("16 groups of 8 random rewards, tau 2", dict(rewards=torch.randn(16, 8, generator=g), tau=2.0)),
        Case("a small tau: 0.01, rewards up to 1 (exp(R / tau) = exp(100))", dict(rewards=verifier, tau=0.01)),
        Case(
            "a small tau, 0.01, and groups whose best rewards differ (1, -0.5 and an outlier 2): each group's own "
            "largest R / tau must come out of its exp",
            dict(
                rewards=torch.tensor([[1.0, 1.0, 1.0, 1.0], [-0.5, -0.5, -0.5, -0.5], [2.0, 0.0, 0.0, 0.0]]), tau=0.01
            ),
        ),
        Case(
            "float64, 4 groups of 6, tau 0.25",
            dict(rewards=torch.rand(4, 6, generator=g, dtype=torch.float64), tau=0.25),
        ),
    ]


_HINTS_SOFT = Hints(
    idea=(
        "GRPO compares each completion with its group's mean reward. DRO compares it with a soft maximum of the "
        "group's rewards, whose softness tau is the same number as the loss's beta: for a large tau it is the mean, "
        "for a small one the best reward in the group. Compute it per group, and keep the exp from overflowing."
    ),
    formula="A[p, g] = R[p, g] - tau * log( (1/G) * sum_g' exp(R[p, g'] / tau) ), computed with the group's "
    "largest R / tau taken out of the exp and added back after the log.",
    solution=_solutions.soft_advantages,
)


@with_hints(_HINTS_SOFT)
def check_soft_advantages(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``soft_advantages(rewards, tau)``: (P, G) rewards and tau > 0 -> (P, G) advantages."""
    return run_checker(
        "Exercise 10.2 soft_advantages",
        fn,
        _library_soft,
        _soft_cases(),
        diagnoses=_SOFT_DIAGNOSES,
        compare=lambda got, expected: compare_tensors(got, expected, rtol=1e-5, atol=1e-5),
        verbose=verbose,
        hints=_HINTS_SOFT,
    )


# ================================================================ 10.3 offline_step (a whole step)
#
# As Chapter 7's capstone: the learner's step and the library's offline_step run for two steps each, from the same
# weights and the same buffer, through trainers that record every call (edurl.exercises.ch07's recording clients),
# and a mistake is named from the records: a sampler used at all, groups that are not the step's draw, log-probs that
# are not the logged ones, a baseline other than each group's mean, the wrong loss or beta.

#: the checked steps' settings: 4 groups x 4 completions, DRO, two steps. Each is away from GRPOConfig's default and
#: the notebook's, so that a value written into the step instead of read from the config shows: the seed (4: a
#: step that draws with seed 0 draws other groups), max_tokens (11, which cuts off the replies with a 3-digit sum,
#: so that some of the drawn groups' rewards carry the format penalty and differ from their correctness), the
#: aggregation and the temperature. The second step runs with half the first's learning rate and beta
#: (SECOND_STEP), so that a number written in that matches one step's config misses the other's.
OFFLINE_CHECK = dict(
    batch_size=4,
    group_size=4,
    loss_fn="dro",
    dro_beta=0.5,
    learning_rate=1e-3,
    max_steps=2,
    temperature=0.9,
    max_tokens=11,
    seed=4,
    aggregation="seq_mean_token_mean",
)
SECOND_STEP = dict(dro_beta=0.25, learning_rate=5e-4)

#: the metrics the notebook reads from each step's row (it plots and tabulates them after training offline)
NOTEBOOK_READS = ("optim/kl_sample_train_v2",)


def _reference_offline_step(config, trainer, buffer, step):
    """The library's step (:func:`edurl.llm.offline.offline_step`) in the exercise's signature."""
    from edurl.llm.offline import offline_step

    return offline_step(config, trainer, buffer, step)


def _offline_setup(base=None, config=None):
    """The config, two recording trainers on the same weights, and a 12-group buffer sampled by those weights."""
    from edurl.exercises.ch07 import _step_setup
    from edurl.llm.grpo import GRPOConfig
    from edurl.llm.offline import collect_buffer

    config, trainers, renderer, task = _step_setup(base, config or GRPOConfig(**OFFLINE_CHECK, progress=False))
    sampler = trainers[0]._trainer.save_weights_and_get_sampling_client("start")
    buffer = collect_buffer(
        {"start": sampler},
        renderer,
        task,
        12,
        config.group_size,
        config.max_tokens,
        config.temperature,
        seed=10,
        progress_bar=False,
    )
    return config, trainers, buffer


def _offline_advantages(got, rewards, correct, config, n: int) -> str | None:
    if got is None:
        return f"step {n}: a completion's advantage varies along its tokens; every action token of it carries one."
    rewards = rewards.double()
    expected = rewards - rewards.mean(dim=1, keepdim=True)
    if torch.allclose(got, expected, atol=1e-5):
        return None
    correct = correct.double()
    if torch.allclose(got, correct - correct.mean(dim=1, keepdim=True), atol=1e-5):
        return (
            f"step {n}: the advantages come from the correctness (buffer.correct), not the reward (buffer.rewards). "
            "The reward also holds the format term: a reply cut off before its answer is boxed loses 0.1."
        )
    if torch.allclose(got, _library_soft(rewards, config.dro_beta), atol=1e-5):
        return (
            f"step {n}: the advantages are DRO's soft ones. This step uses GRPO's: each group's mean reward "
            "subtracted (the notebook runs the soft ones next, and compares)."
        )
    if torch.allclose(got, rewards, atol=1e-5):
        return f"step {n}: the advantages are the raw rewards; subtract each group's mean reward."
    if torch.allclose(got, rewards - rewards.mean(), atol=1e-5):
        return f"step {n}: the baseline is the mean over the whole batch; take each group's own mean."
    if torch.allclose(got, -expected, atol=1e-5):
        return f"step {n}: the sign is flipped: the advantage is the reward minus its group's mean, not the reverse."
    if torch.allclose(got, rewards - rewards.mean(dim=0, keepdim=True), atol=1e-5):
        return (
            f"step {n}: the baseline is the mean over the drawn groups (dim=0), one per completion index; each "
            "group's baseline is the mean of its own rewards: rewards.mean(dim=1, keepdim=True)."
        )
    std = rewards.std(dim=1, keepdim=True)
    if torch.allclose(got * std.clamp_min(1e-3), expected, atol=1e-4) and (std > 1e-3).any():
        return (
            f"step {n}: the advantages are divided by each group's std. This step centres them only (the config's "
            "advantage_scale is 'none'), as DRO's loss expects: subtract the group's mean reward, no more."
        )
    return f"step {n}: the advantages differ from each drawn group's logged rewards minus the group's mean."


def _offline_problem(log, row, ref_log, config, buffer, step) -> str | None:
    from edurl.exercises.ch07 import _advantage_matrix, _check_layout, _check_update, _datums, _field, _match
    from edurl.llm.offline import draw_groups

    n = step + 1
    if log.samples or log.samplers_made:
        return (
            f"step {n}: the step sampled from the model. Offline RL trains on the buffer alone: the completions, "
            "their log-probs and their rewards are all in it."
        )
    if not log.forward_backward:
        return f"step {n}: forward_backward was never called, so no gradient reached the weights."
    datums, ref_datums = _datums(log), _datums(ref_log)
    calls = log.forward_backward
    if len(calls) > 1 and all(
        len(c[0]) == len(ref_datums) and _match(list(c[0]), ref_datums) is not None for c in calls
    ):
        return (
            f"step {n}: forward_backward ran {len(calls)} times on the step's datums. Each call adds its gradient to "
            "the last, so the update took the sum; call it once (its result holds the loss and the metrics)."
        )
    order = _match(datums, ref_datums) if len(datums) == len(ref_datums) else None
    if order is None or sorted(order) != list(range(len(ref_datums))):
        count = (
            ""
            if len(datums) == len(ref_datums)
            else f" ({len(datums)} datums; expected config.batch_size x config.group_size = {len(ref_datums)})"
        )
        return (
            f"step {n}: your datums are not this step's groups{count}. Draw the groups with draw_groups(buffer, "
            "config.batch_size, config.seed, step), and build one datum per completion from buffer.prompts[i] and "
            "the completion."
        )
    for k, (d, i) in enumerate(zip(datums, order)):
        r = ref_datums[i]
        if "logprobs" in d.loss_fn_inputs and torch.equal(_field(d, "mask"), _field(r, "mask")):
            if not torch.allclose(_field(d, "logprobs"), _field(r, "logprobs"), atol=1e-6):
                return (
                    f"step {n}, datum {k}: its logprobs are not the logged ones (buffer.logprobs[i][j]). They are the "
                    "log-probs of the policy that sampled the completion; DRO's penalty measures how far the trainer "
                    "has moved from it, and with the trainer's own log-probs there is no penalty at all."
                )
    problem = _check_layout(datums, ref_datums, order, n)
    if problem:
        return problem
    drawn = draw_groups(buffer, config.batch_size, config.seed, step)
    rewards = torch.tensor([buffer.rewards[i] for i in drawn])
    correct = torch.tensor([buffer.correct[i] for i in drawn])
    problem = _offline_advantages(
        _advantage_matrix(datums, order, (config.batch_size, config.group_size)), rewards, correct, config, n
    ) or _check_update(log, ref_log, config, n)
    return problem or _row_problem(row, n)


def _row_problem(row, n: int) -> str | None:
    """What is wrong with the metrics row a step returned, for train_offline's log and the notebook's table."""
    from edurl.exercises.ch07 import unloggable

    if not isinstance(row, dict):
        return f"step {n}: expected the step's metrics as a dict, got {type(row).__name__}."
    problem = unloggable(row, n)
    if problem:
        return problem
    missing = [k for k in NOTEBOOK_READS if k not in row]
    if missing:
        return (
            f"step {n}: the metrics row lacks {', '.join(map(repr, missing))}, which the notebook reads after training "
            "with your step. Return forward_backward's metrics (its result's .metrics) in the row, with anything "
            "you add."
        )
    return None


def _differs(a, b) -> bool:
    """``a != b``, where a comparison that cannot give one answer (a NumPy array or a tensor written into the
    buffer's plain lists) counts as a change."""
    try:
        return bool(a != b)
    except (ValueError, RuntimeError, TypeError):
        return True


def _changed_buffer(after, before, n: int) -> str | None:
    """What the learner's step changed in the buffer it trained on, which the notebook trains on again after it."""
    field = next(
        (f.name for f in fields(before) if _differs(getattr(after, f.name, None), getattr(before, f.name))), None
    )
    if field is None:
        return None
    old, new = getattr(before, field), getattr(after, field, None)
    if isinstance(new, list) and len(new) != len(old):
        where = f"its {field} went from {len(old)} groups to {len(new)}"
    elif isinstance(new, list):
        where = f"group {next(i for i, (a, b) in enumerate(zip(old, new)) if _differs(a, b))}'s {field} changed"
    else:
        where = f"its {field} changed"
    return (
        f"step {n}: your step changed the buffer it trains on ({where}). The notebook trains on the same buffer "
        "again after it, and every step draws its groups from all of it: read from the buffer and build new lists "
        "and tensors, never write to it (no -=, del or pop on its lists)."
    )


def _compare_offline_steps(fn, base=None, config=None) -> Verdict:
    from edurl.exercises.ch07 import compare_two_steps

    config, trainers, buffer = _offline_setup(base, config)
    configs = [config, *[replace(config, **SECOND_STEP)] * (config.max_steps - 1)]  # see OFFLINE_CHECK
    given = {}  # step -> the copy of the buffer the learner's step got: a step that writes to it is named, and a
    # buffer the two steps shared once let the learner's writes reach the reference's step and the expected rewards

    def run(f, trainer, step):
        own = copy.deepcopy(buffer)
        if f is not _reference_offline_step:
            given[step] = own
        return f(configs[step], trainer, own, step)

    def problem(log, row, ref_log, ref_row, step):
        return _changed_buffer(given.get(step, buffer), buffer, step + 1) or _offline_problem(
            log, row, ref_log, configs[step], buffer, step
        )

    return compare_two_steps(
        "Exercise 10.3 offline_step",
        fn,
        _reference_offline_step,
        trainers,
        config.max_steps,
        run,
        problem,
        f"{config.max_steps} steps of {config.batch_size} logged groups x {config.group_size} completions, each with "
        "its own learning rate and beta: the same datums, advantages, loss and gradients as the library's "
        "offline_step, and the same weights after each update. The notebook now trains offline with your step.",
    )


REFERENCE_TAKES_OVER = "The notebook trains with the library's offline_step; fix yours and run this cell again."

_HINTS_OFFLINE = Hints(
    idea=(
        "An offline step is a GRPO step without the sampling: the groups come from the buffer, already graded and "
        "with the log-probs of the policy that sampled them. Draw this step's groups, centre each group's rewards, "
        "build the datums with the logged log-probs as the sampler's, and take one update with the loss the config "
        "names (DRO, whose penalty keeps the policy near those logged log-probs)."
    ),
    formula="drawn = draw_groups(buffer, P, seed, step); A = rewards[drawn] - each row's mean; one "
    "build_datum(prompt, completion, logged logprobs, A[n, j]) per completion; forward_backward(datums, config.loss_fn, "
    "config.loss_fn_config(), aggregation=..., max_tokens=..., temperature=...); optim_step(AdamParams(lr)).",
    solution=_solutions.offline_step,
)


@with_hints(_HINTS_OFFLINE)
def check_offline_step(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``offline_step(config, trainer, buffer, step) -> dict``: two steps beside the library's
    :func:`edurl.llm.offline.offline_step`, from the same weights and buffer (Chapter 6's SFT checkpoint, cached)."""
    return finish(_compare_offline_steps(fn), _HINTS_OFFLINE, verbose=verbose, on_failure=REFERENCE_TAKES_OVER)
