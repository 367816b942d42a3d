"""The training datum: what one sampled completion becomes before a gradient step (Chapters 6 and 7).

A causal LM predicts token ``t+1`` from tokens ``0..t``. So for a sequence
``tokens = prompt + completion`` (length ``n``)::

    model_input   = tokens[:-1]                       (n-1,)  what the model reads
    target_tokens = tokens[1:]                        (n-1,)  what it is scored on
    logprobs      = 0 ... 0, q(c_0), ..., q(c_k-1)    (n-1,)  sampling log-probs, 0 on prompt targets
    advantages    = 0 ... 0, A, ..., A                (n-1,)  the completion's advantage on every action
    mask          = 0 ... 0, 1, ..., 1                (n-1,)  1 where the target is a sampled action

Position ``i`` of every field is about predicting ``tokens[i+1]``. The first
completion token is predicted at position ``len(prompt) - 1``, so the prompt
contributes ``len(prompt) - 1`` zeros, not ``len(prompt)``. Prompt tokens are
not actions, so their advantage (and mask) is 0: the policy is never pushed
toward or away from text it did not choose.

The names mirror the Tinker API (``Datum``, ``ModelInput.from_ints``,
``loss_fn_inputs``), so cookbook-style loops read the same here.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

DATUM_FIELDS = ("target_tokens", "logprobs", "advantages", "mask")


def _all_ints(tokens: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)


@dataclass(frozen=True)
class ModelInput:
    """The token ids a model reads."""

    tokens: tuple[int, ...]

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        tokens = tokens.tolist() if isinstance(tokens, (torch.Tensor, np.ndarray)) else list(tokens)
        if not _all_ints(tokens):
            tokens = [int(t) if isinstance(t, np.integer) else t for t in tokens]  # NumPy's integers are ids too
            if not _all_ints(tokens):
                raise TypeError(f"ModelInput.from_ints takes int token ids, got {tokens[:5]!r}...")
        return cls(tuple(tokens))

    def to_ints(self) -> list[int]:
        return list(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class Datum:
    """One training sequence: the model input and per-position loss inputs of the same length."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model_input, ModelInput):
            raise TypeError(
                f"model_input must be a ModelInput, got {type(self.model_input).__name__}: build it from the token "
                "ids with ModelInput.from_ints(tokens)"
            )
        n = self.model_input.length
        if n == 0:  # forward_backward failed on it deep in torch (argmax of an empty dimension)
            raise ValueError(
                "model_input is empty: a datum needs at least one position (a prompt of one token and a completion "
                "of one, for build_datum)"
            )
        fixed = {}
        for key, value in self.loss_fn_inputs.items():
            t = torch.as_tensor(value)
            if t.dim() != 1 or t.shape[0] != n:
                raise ValueError(
                    f"loss_fn_inputs[{key!r}] has shape {tuple(t.shape)}, but model_input has {n} tokens; "
                    f"every field needs one value per model_input position, shape ({n},)"
                )
            fixed[key] = t
        self.loss_fn_inputs = fixed


def _checked_tokens(
    prompt_tokens: Sequence[int], completion_tokens: Sequence[int], sampling_logprobs: Sequence[float]
) -> tuple[list[int], list[int]]:
    """The prompt and completion as lists, once they are known to make a datum."""
    prompt, completion = list(prompt_tokens), list(completion_tokens)
    if not prompt:
        raise ValueError("prompt_tokens is empty; the first action must be predicted from at least one token")
    if len(sampling_logprobs) != len(completion):
        raise ValueError(
            f"{len(sampling_logprobs)} sampling log-probs for {len(completion)} completion tokens; "
            "pass one log-prob per sampled token"
        )
    return prompt, completion


def build_datum(
    prompt_tokens: Sequence[int], completion_tokens: Sequence[int], sampling_logprobs: Sequence[float], advantage: float
) -> Datum:
    """Reference implementation of the datum layout in the module docstring."""
    prompt, completion = _checked_tokens(prompt_tokens, completion_tokens, sampling_logprobs)
    tokens = prompt + completion
    n_prompt = len(prompt) - 1  # targets that are prompt tokens
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": torch.tensor(tokens[1:], dtype=torch.long, device="cpu"),
            "logprobs": torch.tensor([0.0] * n_prompt + [float(x) for x in sampling_logprobs], device="cpu"),
            "advantages": torch.tensor([0.0] * n_prompt + [float(advantage)] * len(completion), device="cpu"),
            "mask": torch.tensor([0.0] * n_prompt + [1.0] * len(completion), device="cpu"),
        },
    )


def build_datums(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    sampling_logprobs: Sequence[Sequence[float]],
    advantages: Sequence[float],
) -> list[Datum]:
    """``[build_datum(p, c, lp, a) for p, c, lp, a in zip(...)]``, the same datums, built from one tensor per field
    for the whole batch (each datum's fields are views into it): a GRPO step builds hundreds, and four small
    tensors per datum cost more than the grading. Token ids must be ints (a float is refused, as by
    :func:`build_datum`; a bool is not)."""
    if not len(prompts) == len(completions) == len(sampling_logprobs) == len(advantages):
        raise ValueError(
            f"{len(prompts)} prompts, {len(completions)} completions, {len(sampling_logprobs)} log-prob lists and "
            f"{len(advantages)} advantages; pass one of each per datum"
        )
    firsts, targets, logprobs, spans = [], [], [], []
    for prompt, completion, lps in zip(prompts, completions, sampling_logprobs):
        prompt, completion = _checked_tokens(prompt, completion, lps)
        tokens = prompt + completion
        firsts.append(tokens[0])  # the one token that no target holds
        targets += tokens[1:]
        logprobs += [0.0] * (len(prompt) - 1)
        logprobs += map(float, lps)
        spans += (len(prompt) - 1, len(completion))  # prompt targets, then actions
    try:  # an array checks every id is an int in C, and fills a tensor far faster than a list does
        flat_targets = (
            torch.frombuffer(array("q", targets), dtype=torch.long)
            if targets
            else torch.zeros(0, dtype=torch.long, device="cpu")
        )
        array("q", firsts)
    except TypeError as error:
        raise TypeError(f"token ids must be ints ({error}); pass the token ids as ints") from error
    counts = torch.tensor(spans, dtype=torch.long, device="cpu")
    lengths = counts.view(-1, 2).sum(1).tolist()
    # each model input is its first token and its targets but the last, as Python ints (a NumPy or torch id once
    # stayed one in the ModelInput, where build_datum converts it or refuses it)
    ids, inputs, start = flat_targets.tolist(), [], 0
    for first, n in zip(array("q", firsts).tolist(), lengths):
        inputs.append((first, *ids[start : start + n - 1]) if n else ())  # one token alone: no position
        start += n
    real = torch.get_default_dtype()  # build_datum's float fields take the default dtype: the same datums
    is_action = torch.tensor([False, True], device="cpu").repeat(len(inputs)).repeat_interleave(counts)
    per_datum = torch.tensor([float(a) for a in advantages], dtype=real, device="cpu")
    code = "f" if real == torch.float32 else "d"  # float32 directly; any other dtype through float64
    fields = {
        "target_tokens": flat_targets.split(lengths),
        "logprobs": torch.frombuffer(array(code, logprobs), dtype=torch.float32 if code == "f" else torch.float64)
        .to(real)
        .split(lengths)
        if logprobs
        else torch.zeros(0, dtype=real, device="cpu").split(lengths),
        "advantages": torch.where(
            is_action, per_datum.repeat_interleave(torch.tensor(lengths, dtype=torch.long, device="cpu")), 0.0
        ).split(lengths),
        "mask": is_action.to(real).split(lengths),
    }
    return [
        Datum(ModelInput(tokens), {key: pieces[i] for key, pieces in fields.items()}) for i, tokens in enumerate(inputs)
    ]


def build_supervised_datum(tokens: Sequence[int], weights: Sequence[float]) -> Datum:
    """A ``cross_entropy`` datum from a whole conversation and a weight per token (e.g.
    :meth:`ChatMLRenderer.build_supervised_example`): position ``i`` predicts ``tokens[i+1]`` with
    weight ``weights[i+1]``, so the loss covers the reply and never the prompt."""
    tokens, weights = list(tokens), [float(w) for w in weights]
    if len(tokens) != len(weights):
        raise ValueError(f"{len(tokens)} tokens but {len(weights)} weights; pass one weight per token")
    if len(tokens) < 2:
        raise ValueError("a supervised datum needs at least two tokens: one to read and one to predict")
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": torch.tensor(tokens[1:], dtype=torch.long, device="cpu"),
            "weights": torch.tensor(weights[1:], device="cpu"),
        },
    )
