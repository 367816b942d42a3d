"""Checkers for Chapter 7's exercises: group advantages (7.1), the per-token PPO loss (7.2) and one group's
masked training datums (7.3). Each compares the learner's function with the library's reference."""

from __future__ import annotations

import torch

from edurl.exercises._core import (
    Case,
    CheckFailure,
    Diagnosis,
    Hints,
    Verdict,
    compare_outputs,
    compare_tensors,
    run_checker,
    with_hints,
)
from edurl.exercises.ch06 import datum_shifted_by_prompt_length, datum_with_unmasked_prompt
from edurl.exercises.solutions import ch07 as _solutions
from edurl.llm.datum import DATUM_FIELDS, Datum
from edurl.llm.datum import build_datum as _library_build_datum
from edurl.llm.losses import group_advantages as _library_group_advantages
from edurl.llm.losses import ppo as _library_ppo

__all__ = ["check_group_advantages", "check_masked_datums", "check_ppo_loss"]


# ================================================================ 7.1 group_advantages


def _reference_group_advantages(rewards):
    return _library_group_advantages(rewards, scale="none")


def _batch_mean(rewards):
    return rewards - rewards.mean()


def _mean_over_prompts(rewards):
    return rewards - rewards.mean(dim=0, keepdim=True)


def _no_keepdim(rewards):
    # (P, G) - (P,) broadcasts the P group means along the G axis; it only runs when P == G (or P == 1)
    return rewards - rewards.mean(dim=1)


def _group_std_scaled(rewards):
    return _library_group_advantages(rewards, scale="group")


def _group_std_no_eps(rewards):
    return (rewards - rewards.mean(dim=1, keepdim=True)) / rewards.std(dim=1, keepdim=True)


def _group_population_std(rewards):
    return (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True, unbiased=False) + 1e-6)


def _raw_rewards(rewards):
    return rewards.clone()


_STD_HINT = (
    "you divided by the group's std (GRPO's scaling). This exercise asks for centring only, as in Dr. GRPO: "
    "A = R - mean over the group, with no division (which also avoids 0 / 0 = NaN on a group whose rewards "
    "are all equal)."
)

_GROUP_ADVANTAGES_DIAGNOSES = [
    Diagnosis(_raw_rewards, "you returned the rewards unchanged: subtract each group's mean reward."),
    Diagnosis(_group_std_scaled, _STD_HINT),
    Diagnosis(_group_std_no_eps, _STD_HINT),
    Diagnosis(_group_population_std, _STD_HINT),
    Diagnosis(
        _batch_mean,
        "you subtracted the mean over the whole batch. The baseline is per group: each prompt's "
        "completions are compared with each other, rewards.mean(dim=1, keepdim=True).",
    ),
    Diagnosis(
        _mean_over_prompts,
        "you took the mean over dim=0, across prompts for each sample index. A group is a "
        "row of the (P, G) rewards: use rewards.mean(dim=1, keepdim=True).",
    ),
    Diagnosis(
        _no_keepdim,
        "rewards.mean(dim=1) has shape (P,), and (P, G) - (P,) broadcasts it along the wrong "
        "axis (sample g gets group g's mean). Keep the group axis: mean(dim=1, keepdim=True).",
    ),
]


def _group_advantages_cases() -> list[Case]:
    g = torch.Generator().manual_seed(71)
    binary = (torch.rand(8, 16, generator=g) < 0.5).float()  # (P, G) pass/fail rewards
    binary[2] = 1.0  # an all-correct group and an all-wrong one, as a verifier gives on easy and hard prompts
    binary[5] = 0.0
    return [
        # hand-computed: mean 0.625, so [1 - .625, .5 - .625, 0 - .625, 1 - .625]
        Case(
            "worked example: one group [1, .5, 0, 1] -> [.375, -.125, -.625, .375]",
            dict(rewards=torch.tensor([[1.0, 0.5, 0.0, 1.0]])),
        ),
        # means 1/3, 1, 0.5 -> [[2/3, -1/3, -1/3], [0, 0, 0], [-.5, .5, 0]]
        Case(
            "3 prompts x 3 samples, one group all correct",
            dict(rewards=torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.5]])),
        ),
        Case(
            "every group has equal rewards (all advantages 0)",
            dict(rewards=torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])),
        ),
        Case("8 prompts x 16 pass/fail samples", dict(rewards=binary)),
        Case(
            "4 prompts x 5 real-valued rewards, float64",
            dict(rewards=torch.randn(4, 5, generator=g, dtype=torch.float64) * 3 + 2),
        ),
    ]


_HINTS_GROUP_ADVANTAGES = Hints(
    idea=(
        "Each row is one prompt's group of completions. A completion's advantage is how much better its "
        "reward is than what its own group got on average, and a group that all got the same reward teaches "
        "nothing."
    ),
    formula="A = rewards - rewards.mean(dim=1, keepdim=True): row p is prompt p's group of "
    "G completions; no division by the std.",
    solution=_solutions.group_advantages,
)


@with_hints(_HINTS_GROUP_ADVANTAGES)
def check_group_advantages(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``group_advantages(rewards)``: (P, G) rewards -> (P, G) rewards minus each group's mean."""
    return run_checker(
        "Exercise 7.1 group_advantages",
        fn,
        _reference_group_advantages,
        _group_advantages_cases(),
        diagnoses=_GROUP_ADVANTAGES_DIAGNOSES,
        compare=lambda got, expected: compare_tensors(got, expected, rtol=1e-5, atol=1e-6),
        verbose=verbose,
        hints=_HINTS_GROUP_ADVANTAGES,
    )


# ================================================================ 7.2 ppo_loss


def _reference_ppo(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    return _library_ppo(train_logprobs, sampling_logprobs, advantages, clip_low_threshold, clip_high_threshold)


def _ppo_max(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    ratio = torch.exp(train_logprobs - sampling_logprobs)
    return -torch.max(ratio * advantages, ratio.clamp(clip_low_threshold, clip_high_threshold) * advantages)


def _ppo_no_minus(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    return -_reference_ppo(train_logprobs, sampling_logprobs, advantages, clip_low_threshold, clip_high_threshold)


def _ppo_always_clipped(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    return -(torch.exp(train_logprobs - sampling_logprobs).clamp(clip_low_threshold, clip_high_threshold) * advantages)


def _ppo_never_clipped(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    return -(torch.exp(train_logprobs - sampling_logprobs) * advantages)


def _ppo_ratio_of_logprobs(
    train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2
):
    ratio = train_logprobs / sampling_logprobs
    return -torch.min(ratio * advantages, ratio.clamp(clip_low_threshold, clip_high_threshold) * advantages)


def _ppo_inverted_ratio(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    ratio = torch.exp(sampling_logprobs - train_logprobs)
    return -torch.min(ratio * advantages, ratio.clamp(clip_low_threshold, clip_high_threshold) * advantages)


def _ppo_clip_advantage(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    ratio = torch.exp(train_logprobs - sampling_logprobs)
    return -torch.min(ratio * advantages, ratio * advantages.clamp(clip_low_threshold, clip_high_threshold))


def _ppo_clip_product(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    ratio = torch.exp(train_logprobs - sampling_logprobs)
    return -torch.min(ratio * advantages, (ratio * advantages).clamp(clip_low_threshold, clip_high_threshold))


def _ppo_bounds_as_eps(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    ratio = torch.exp(train_logprobs - sampling_logprobs)
    return -torch.min(ratio * advantages, ratio.clamp(1 - clip_low_threshold, 1 + clip_high_threshold) * advantages)


def _ppo_detached_ratio(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    return _reference_ppo(
        train_logprobs.detach(), sampling_logprobs, advantages, clip_low_threshold, clip_high_threshold
    )


_PPO_DIAGNOSES = [
    Diagnosis(
        _ppo_no_minus,
        "the sign is flipped. min(r*A, clip(r)*A) is an objective to *maximise*; optimisers "
        "minimise, so the loss is its negative.",
    ),
    Diagnosis(
        _ppo_detached_ratio,
        "the gradient is zero everywhere: the ratio was detached from train_logprobs "
        "(.detach(), .item(), torch.no_grad() or a NumPy round trip). The whole point of "
        "r = exp(train_logprobs - sampling_logprobs) is that its gradient flows into train_logprobs.",
    ),
    Diagnosis(
        _ppo_max,
        "you took max() instead of min(). PPO is pessimistic: it keeps the *smaller* of r*A and "
        "clip(r)*A, which removes the incentive to move r past the range in the direction A favours.",
    ),
    Diagnosis(
        _ppo_always_clipped,
        "you return -clip(r)*A without the min(), so the gradient is zero whenever r is "
        "outside [clip_low_threshold, clip_high_threshold], on both sides. min(r*A, clip(r)*A) keeps the "
        "unclipped term where it is smaller, so a move that undoes a bad step keeps its "
        "gradient (A > 0 with r < clip_low_threshold, A < 0 with r > clip_high_threshold).",
    ),
    Diagnosis(
        _ppo_never_clipped,
        "nothing is clipped: this is the plain importance-sampling loss -r*A. Take "
        "-min(r*A, clamp(r, clip_low_threshold, clip_high_threshold)*A).",
    ),
    Diagnosis(
        _ppo_ratio_of_logprobs,
        "the ratio is of probabilities, not log-probabilities: r = pi / pi_sampler = "
        "exp(train_logprobs - sampling_logprobs), not train_logprobs / sampling_logprobs.",
    ),
    Diagnosis(
        _ppo_inverted_ratio,
        "the ratio is upside down: r = pi / pi_sampler = exp(train_logprobs - sampling_logprobs)"
        ", not exp(sampling_logprobs - train_logprobs).",
    ),
    Diagnosis(
        _ppo_clip_advantage,
        "you clipped the advantage. Clip the ratio: clamp(r, clip_low_threshold, clip_high_threshold) * A.",
    ),
    Diagnosis(
        _ppo_clip_product,
        "you clipped the product r*A. Clip the ratio alone, then multiply: "
        "clamp(r, clip_low_threshold, clip_high_threshold) * A.",
    ),
    Diagnosis(
        _ppo_bounds_as_eps,
        "clip_low_threshold and clip_high_threshold bound the ratio itself (0.8 and 1.2 for PPO's eps = 0.2): "
        "clamp(r, clip_low_threshold, clip_high_threshold), not clamp(r, 1 - clip_low_threshold, 1 + clip_high_threshold).",
    ),
]


def _per_token_loss_and_grad(fn):
    """Run ``fn`` on a fresh leaf ``train_logprobs`` and return (per-token loss, d sum(loss) / d train_logprobs).

    Each token's loss depends on its own log-prob only, so the gradient of the sum is the per-token gradient.
    A loss with no graph back to ``train_logprobs`` gets a zero gradient, which the diagnoses can then name.
    """

    def run(train_logprobs, sampling_logprobs, advantages, *clip_range):
        train_logprobs = train_logprobs.detach().clone().requires_grad_(True)
        loss = fn(train_logprobs, sampling_logprobs, advantages, *clip_range)
        if isinstance(loss, torch.Tensor) and loss.shape != train_logprobs.shape:
            hint = (
                " Do not reduce it (no .mean() or .sum()): aggregation over tokens comes later."
                if loss.numel() == 1
                else ""
            )
            raise CheckFailure(
                f"expected the per-token loss, shape {tuple(train_logprobs.shape)} like train_logprobs, got shape "
                f"{tuple(loss.shape)}.{hint}"
            )
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return loss, torch.zeros_like(train_logprobs)
        (grad,) = torch.autograd.grad(loss.sum(), train_logprobs, allow_unused=True)
        return loss.detach(), torch.zeros_like(train_logprobs) if grad is None else grad

    return run


def _ppo_cases() -> list[Case]:
    g = torch.Generator().manual_seed(72)
    # ratios below, inside and above [0.8, 1.2] (and beyond [0.2, 2.2]); row 0 has A = +2, row 1 A = -0.5
    ratios = torch.tensor([0.1, 0.5, 1.0, 1.5, 3.0])
    q = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.5], [-0.7, -1.2, -2.5, -0.3, -4.0]])  # (2, 5)
    # hand-computed: A = +2 -> loss -2r below and inside, -2.4 above (gradient -2r, -2r, -2r, 0, 0);
    #                A = -0.5 -> loss 0.4 below (gradient 0), 0.5r inside and above (gradient 0.5r)
    cases = [
        Case(
            "ratios 0.1 .. 3 with A = +2 (row 0) and A = -0.5 (row 1)",
            dict(
                train_logprobs=q + ratios.log(),
                sampling_logprobs=q,
                advantages=torch.tensor([[2.0] * 5, [-0.5] * 5]),
                clip_low_threshold=0.8,
                clip_high_threshold=1.2,
            ),
        ),
    ]
    q = -torch.rand(3, 6, generator=g) * 4
    cases.append(
        Case(
            "on-policy: train_logprobs == sampling_logprobs (r = 1)",
            dict(
                train_logprobs=q.clone(),
                sampling_logprobs=q,
                advantages=torch.randn(3, 6, generator=g),
                clip_low_threshold=0.8,
                clip_high_threshold=1.2,
            ),
        )
    )
    q = -torch.rand(4, 16, generator=g) * 4
    cases.append(
        Case(
            "4 x 16 tokens, default clip range (no clip arguments passed)",
            dict(
                train_logprobs=q + torch.randn(4, 16, generator=g) * 0.3,
                sampling_logprobs=q,
                advantages=torch.randn(4, 16, generator=g),
            ),
        )
    )
    q = -torch.rand(8, 32, generator=g) * 4
    cases.append(
        Case(
            "8 x 32 tokens, asymmetric range [0.8, 1.28] (DAPO's clip-higher)",
            dict(
                train_logprobs=q + torch.randn(8, 32, generator=g) * 0.3,
                sampling_logprobs=q,
                advantages=torch.randn(8, 1, generator=g).expand(8, 32).clone(),
                clip_low_threshold=0.8,
                clip_high_threshold=1.28,
            ),
        )
    )
    q = -torch.rand(2, 3, 10, generator=g, dtype=torch.float64) * 4
    cases.append(
        Case(
            "(P, G, T) = (2, 3, 10) tokens in float64, range [0.9, 1.1]",
            dict(
                train_logprobs=q + torch.randn(2, 3, 10, generator=g, dtype=torch.float64) * 0.2,
                sampling_logprobs=q,
                advantages=torch.randn(2, 3, 1, generator=g, dtype=torch.float64).expand(2, 3, 10).clone(),
                clip_low_threshold=0.9,
                clip_high_threshold=1.1,
            ),
        )
    )
    return cases


_HINTS_PPO_LOSS = Hints(
    idea=(
        "Per token, the ratio of the new policy's probability to the sampler's. Of the plain and the clipped "
        "objective take the more pessimistic one, keep one value per token, and negate it for the optimiser."
    ),
    formula="r = exp(train_logprobs - sampling_logprobs); loss = -min(r * A, clamp(r, clip_low_threshold, "
    "clip_high_threshold) * A), one value per token, with the gradient flowing through r.",
    solution=_solutions.ppo_loss,
)


@with_hints(_HINTS_PPO_LOSS)
def check_ppo_loss(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's per-token ``ppo_loss(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8,
    clip_high_threshold=1.2)``: its values and its gradient with respect to ``train_logprobs``."""
    return run_checker(
        "Exercise 7.2 ppo_loss",
        fn,
        _reference_ppo,
        _ppo_cases(),
        diagnoses=_PPO_DIAGNOSES,
        wrap=_per_token_loss_and_grad,
        compare=compare_outputs(["per-token loss", "d loss / d train_logprobs"], rtol=1e-4, atol=1e-6),
        verbose=verbose,
        hints=_HINTS_PPO_LOSS,
    )


# ================================================================ 7.3 build_datums

_FIELDS = ("model_input", *DATUM_FIELDS)


def _reference_build_datums(prompt_tokens, completions, advantages):
    return [
        _library_build_datum(prompt_tokens, tokens, train_logprobs, advantage)
        for (tokens, train_logprobs), advantage in zip(completions, advantages)
    ]


def _per_completion(build_one):
    """A group builder that applies a (buggy) one-completion builder to every completion."""

    def build(prompt_tokens, completions, advantages):
        return [
            build_one(prompt_tokens, tokens, train_logprobs, advantage)
            for (tokens, train_logprobs), advantage in zip(completions, advantages)
        ]

    return build


def _first_advantage_everywhere(prompt_tokens, completions, advantages):
    return _reference_build_datums(prompt_tokens, completions, [advantages[0]] * len(completions))


def _advantage_on_last_token(prompt_tokens, completions, advantages):
    datums = []
    for d in _reference_build_datums(prompt_tokens, completions, advantages):
        adv = d.loss_fn_inputs["advantages"]
        only_last = torch.zeros_like(adv)
        only_last[-1] = adv[-1]  # the reward arrives at the last token, but every action shares the credit
        datums.append(Datum(d.model_input, {**d.loss_fn_inputs, "advantages": only_last}))
    return datums


_DATUMS_DIAGNOSES = [
    Diagnosis(
        _per_completion(datum_with_unmasked_prompt),
        "the prompt is not masked: prompt tokens were not sampled by the "
        "policy, so their advantage and mask must be 0.",
    ),
    Diagnosis(
        _per_completion(datum_shifted_by_prompt_length),
        "off by one: the first sampled token is predicted at "
        "position len(prompt) - 1 (from the last prompt token), so the "
        "prompt contributes len(prompt) - 1 zeros, not len(prompt).",
    ),
    Diagnosis(
        _first_advantage_everywhere,
        "every completion got the same advantage (advantages[0]). Completion i "
        "gets advantages[i]: zip(completions, advantages).",
    ),
    Diagnosis(
        _advantage_on_last_token,
        "only the last token carries the advantage. The completion's advantage "
        "applies to every sampled token: A on each position where mask is 1.",
    ),
]


def _datums_as_rows(fn):
    """Run ``fn`` and lay each Datum out as one float tensor of rows (model_input, *DATUM_FIELDS), shape (5, L)."""

    def run(prompt_tokens, completions, advantages):
        datums = fn(prompt_tokens, completions, advantages)
        if isinstance(datums, Datum):
            raise CheckFailure(
                f"expected a list of Datums, one per completion ({len(completions)}), got a single "
                "Datum. Build one for each (tokens, sampling_logprobs) pair in completions."
            )
        if not isinstance(datums, (list, tuple)):
            extra = " (did you forget the `return` statement?)" if datums is None else ""
            raise CheckFailure(f"expected a list of Datums, got {type(datums).__name__}{extra}.")
        if len(datums) != len(completions):
            raise CheckFailure(f"expected one Datum per completion, {len(completions)}, got {len(datums)}.")
        rows = []
        for i, datum in enumerate(datums):
            if not isinstance(datum, Datum):
                raise CheckFailure(
                    f"element {i} is a {type(datum).__name__}, not a Datum. Return "
                    "Datum(model_input=ModelInput.from_ints(...), loss_fn_inputs={...})."
                )
            missing = [k for k in DATUM_FIELDS if k not in datum.loss_fn_inputs]
            if missing:
                raise CheckFailure(f"datum {i}: loss_fn_inputs lacks {missing}; it needs {list(DATUM_FIELDS)}.")
            rows.append(
                torch.stack(
                    [
                        torch.tensor(datum.model_input.to_ints(), dtype=torch.float32),
                        *(torch.as_tensor(datum.loss_fn_inputs[k]).float() for k in DATUM_FIELDS),
                    ]
                )
            )
        return tuple(rows)

    return run


def _compare_datums(got: tuple, expected: tuple) -> str | None:
    for i, (g, e) in enumerate(zip(got, expected)):
        if g.shape != e.shape:
            return f"datum {i}: expected {e.shape[1]} positions (len(prompt) + len(completion) - 1), got {g.shape[1]}."
        problem = compare_outputs(_FIELDS, rtol=1e-6, atol=1e-6)(tuple(g), tuple(e))
        if problem:
            return f"datum {i}, {problem} Each datum is shown below as the rows {', '.join(_FIELDS)}."
    return None


def _datums_cases() -> list[Case]:
    g = torch.Generator().manual_seed(73)
    cases = [
        Case(
            "3-token prompt, 2 completions with advantages +0.5 and -0.5",
            dict(
                prompt_tokens=[10, 11, 12],
                completions=[([20, 21], [-0.5, -0.25]), ([22, 23, 24], [-1.0, -0.1, -2.0])],
                advantages=[0.5, -0.5],
            ),
        ),
        Case(
            "1-token prompt, 4 completions (one a single token)",
            dict(
                prompt_tokens=[7],
                completions=[
                    ([8, 9], [-1.0, -2.0]),
                    ([3], [-0.4]),
                    ([5, 6, 2], [-0.3, -0.2, -0.9]),
                    ([4, 4], [-1.5, -0.6]),
                ],
                advantages=[0.75, -0.25, -0.25, -0.25],
            ),
        ),
        Case(
            "zero-variance group: every advantage 0",
            dict(
                prompt_tokens=[3, 1, 4, 1, 5],
                completions=[([9, 2], [-0.1, -0.2]), ([6, 5, 3], [-0.3, -0.4, -0.5])],
                advantages=[0.0, 0.0],
            ),
        ),
    ]
    n_prompt, lengths = 20, torch.randint(1, 13, (8,), generator=g).tolist()
    rewards = (torch.rand(1, 8, generator=g) < 0.5).float()
    rewards[0, :2] = torch.tensor([0.0, 1.0])  # never a zero-variance group
    cases.append(
        Case(
            f"random {n_prompt}-token prompt, group of 8 completions",
            dict(
                prompt_tokens=torch.randint(5, 100, (n_prompt,), generator=g).tolist(),
                completions=[
                    (torch.randint(5, 100, (n,), generator=g).tolist(), (-torch.rand(n, generator=g) * 3).tolist())
                    for n in lengths
                ],
                advantages=_library_group_advantages(rewards)[0].tolist(),
            ),
        )
    )
    return cases


_HINTS_BUILD_DATUMS = Hints(
    idea="One datum per completion, exactly as in exercise 6.1, each carrying its own completion's advantage.",
    formula="for completion i: tokens = prompt + completion; model_input = tokens[:-1]; "
    "target_tokens = tokens[1:]; train_logprobs, advantages and mask are 0 on the "
    "len(prompt) - 1 prompt targets, then the sampled log-probs, advantages[i], "
    "and 1.",
    solution=_solutions.build_datums,
)


@with_hints(_HINTS_BUILD_DATUMS)
def check_masked_datums(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``build_datums(prompt_tokens, completions, advantages)``: one masked Datum per completion
    of a group, ``completions`` being (tokens, sampling_logprobs) pairs and ``advantages`` one float each."""
    return run_checker(
        "Exercise 7.3 build_datums",
        fn,
        _reference_build_datums,
        _datums_cases(),
        diagnoses=_DATUMS_DIAGNOSES,
        compare=_compare_datums,
        wrap=_datums_as_rows,
        verbose=verbose,
        hints=_HINTS_BUILD_DATUMS,
    )
