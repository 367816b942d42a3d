"""Worked solutions for Chapter 7. Open them with ``edurl.exercises.show_solution(name)``, name one of
"group_advantages", "ppo_loss" and "masked_datums"."""

import torch

from edurl.exercises.solutions.ch06 import build_datum


def group_advantages(rewards):
    """Exercise 7.1: rewards (P, G), P prompts with G sampled completions each -> advantages (P, G).

    The baseline of a completion is the mean reward of its own group (the other answers to the same
    prompt), so keep the group axis: mean(dim=1, keepdim=True) is (P, 1) and broadcasts along G.
    No division by the std (Dr. GRPO): a group whose rewards are all equal simply gets 0 everywhere.
    Example: [[1, .5, 0, 1]] has mean .625 -> [[.375, -.125, -.625, .375]].
    """
    return rewards - rewards.mean(dim=1, keepdim=True)  # (P, G) - (P, 1)


def ppo_loss(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    """Exercise 7.2: the clipped surrogate, one loss per token; every input and the result share one shape.

    r = pi / pi_sampler, computed from log-probs as exp(lp - q) so the gradient flows into train_logprobs.
    min() is pessimistic: once r has left [clip_low_threshold, clip_high_threshold] in the direction A favours, the clipped
    term is the smaller one, it is constant in r, and the token's gradient is 0. Moves that undo a bad
    step (A > 0 with r < clip_low_threshold, A < 0 with r > clip_high_threshold) keep the unclipped term and its gradient.
    """
    ratio = torch.exp(train_logprobs - sampling_logprobs)
    clipped = ratio.clamp(clip_low_threshold, clip_high_threshold)
    return -torch.min(ratio * advantages, clipped * advantages)  # minimise the negative objective


def build_datums(prompt_tokens, completions, advantages):
    """Exercise 7.3: one masked Datum per completion of a group, each laid out by Exercise 6.1's build_datum
    (`show_solution("build_datum")` shows that layout)."""
    # completion i gets advantages[i]: the group's baseline already made them relative to each other
    return [
        build_datum(prompt_tokens, completion_tokens, sampling_logprobs, advantage)
        for (completion_tokens, sampling_logprobs), advantage in zip(completions, advantages)
    ]
