"""Worked solutions for Chapter 7. Open them with ``edurl.exercises.show_solution(name)``, name one of
"group_advantages", "ppo_loss" and "masked_datums"."""

import torch

from edurl.llm.datum import Datum, ModelInput


def group_advantages(rewards):
    """Exercise 7.1: rewards (P, G), P prompts with G sampled completions each -> advantages (P, G).

    The baseline of a completion is the mean reward of its own group (the other answers to the same
    prompt), so keep the group axis: mean(dim=1, keepdim=True) is (P, 1) and broadcasts along G.
    No division by the std (Dr. GRPO): a group whose rewards are all equal simply gets 0 everywhere.
    Example: [[1, .5, 0, 1]] has mean .625 -> [[.375, -.125, -.625, .375]].
    """
    return rewards - rewards.mean(dim=1, keepdim=True)  # (P, G) - (P, 1)


def ppo_loss(logprobs, sampling_logprobs, advantages, clip_low=0.8, clip_high=1.2):
    """Exercise 7.2: the clipped surrogate, one loss per token; every input and the result share one shape.

    r = pi / pi_sampler, computed from log-probs as exp(lp - q) so the gradient flows into logprobs.
    min() is pessimistic: once r has left [clip_low, clip_high] in the direction A favours, the clipped
    term is the smaller one, it is constant in r, and the token's gradient is 0. Moves that undo a bad
    step (A > 0 with r < clip_low, A < 0 with r > clip_high) keep the unclipped term and its gradient.
    """
    ratio = torch.exp(logprobs - sampling_logprobs)
    clipped = ratio.clamp(clip_low, clip_high)
    return -torch.min(ratio * advantages, clipped * advantages)  # minimise the negative objective


def build_datums(prompt_tokens, completions, advantages):
    """Exercise 7.3: one masked Datum per completion of a group (the layout of Exercise 6.1)."""
    datums = []
    # completion i gets advantages[i]: the group's baseline already made them relative to each other
    for (completion_tokens, sampling_logprobs), advantage in zip(completions, advantages):
        tokens = list(prompt_tokens) + list(completion_tokens)
        # position i predicts tokens[i + 1], so len(prompt) - 1 targets are prompt tokens
        n_prompt_targets = len(prompt_tokens) - 1
        n_actions = len(completion_tokens)
        datums.append(Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": torch.tensor(tokens[1:]),
                "logprobs": torch.tensor([0.0] * n_prompt_targets + list(sampling_logprobs)),
                # prompt targets were not sampled: masked out; every sampled token shares the advantage
                "advantages": torch.tensor([0.0] * n_prompt_targets + [float(advantage)] * n_actions),
                "mask": torch.tensor([0.0] * n_prompt_targets + [1.0] * n_actions),
            },
        ))
    return datums
