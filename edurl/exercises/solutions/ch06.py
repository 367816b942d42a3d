"""Worked solution for Chapter 6. Open it with ``edurl.exercises.show_solution("build_datum")``."""

import torch

from edurl.llm.datum import Datum, ModelInput


def build_datum(prompt_tokens, completion_tokens, sampling_logprobs, advantage):
    """Exercise 6.1: one sampled completion as a training datum."""
    tokens = list(prompt_tokens) + list(completion_tokens)
    # Position i of every field is about predicting tokens[i + 1] from tokens[: i + 1].
    # The first prompt token is never a target, so len(prompt) - 1 targets are prompt tokens.
    n_prompt_targets = len(prompt_tokens) - 1
    n_actions = len(completion_tokens)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": torch.tensor(tokens[1:]),
            # prompt tokens were not sampled: no log-prob, no advantage, masked out
            "logprobs": torch.tensor([0.0] * n_prompt_targets + list(sampling_logprobs)),
            "advantages": torch.tensor([0.0] * n_prompt_targets + [float(advantage)] * n_actions),
            "mask": torch.tensor([0.0] * n_prompt_targets + [1.0] * n_actions),
        },
    )
