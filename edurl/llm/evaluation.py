"""Held-out evaluation of a policy on a task: pass@1 and format rate (Chapters 6 and 7)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edurl._checks import check_count
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.rewards import grade
from edurl.llm.sampling import SamplingParams, sample
from edurl.llm.shared_prefix import scaled_log_softmax
from edurl.llm.tasks import Problem
from edurl.utils import warn_at_caller


@dataclass
class EvalResult:
    """Held-out scores, each a fraction in [0, 1]."""

    pass_at_1: float
    """Share of completions graded correct (greedy: one per problem)."""
    format: float
    """Share of completions with a well-formed, complete ``\\boxed{}`` answer."""
    samples: list[tuple[str, str, str]]
    """(question, reply, reference answer) for the first few problems."""


def evaluate(
    model,
    renderer: ChatMLRenderer,
    problems: Sequence[Problem],
    temperature: float = 0.0,
    max_tokens: int = 16,
    batch_size: int = 256,
    seed: int = 0,
    keep_samples: int = 8,
    *,
    check_max_tokens: bool = True,
) -> EvalResult:
    """Answer every problem once and grade it. ``temperature=0`` (greedy) is the default.

    Warns when ``max_tokens`` cuts off some problems' reference replies (:func:`warn_if_cut`), unless
    ``check_max_tokens=False``: the training loop warns once when it starts, and not again at every evaluation."""
    if not problems:
        raise ValueError("problems is empty; pass e.g. task.sample(200, split='test')")
    check_count(batch_size, "batch_size", "problems per sampling call")  # -1 once sampled nothing and gave 0 %
    if check_max_tokens:
        warn_if_cut(renderer, problems, max_tokens)
    correct, fmt, samples = 0.0, 0.0, []
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, stop=renderer.get_stop_sequences(), seed=seed
    )
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        if seed is not None:  # one seed for every batch gave row i of each batch the same draws (batch_size=1: one
            params = dataclasses.replace(params, seed=seed + start)  # stream for every problem); greedy is unchanged
        prompts = [renderer.build_generation_prompt(p.messages()) for p in chunk]
        for p, c in zip(chunk, sample(model, prompts, 1, params, pad_token_id=renderer.tokenizer.pad_token_id)):
            message, ok = renderer.parse_response(c.tokens, c.stop_reason)
            g = grade(message["content"], p.answer, complete=ok)
            correct += g.correct
            fmt += g.format
            if len(samples) < keep_samples:
                samples.append((p.question, message["content"], p.answer))
    return EvalResult(pass_at_1=correct / len(problems), format=fmt / len(problems), samples=samples)


def warn_if_cut(
    renderer: ChatMLRenderer, problems: Sequence[Problem], max_tokens: int, whose: str = "the problems'"
) -> None:
    """Warn when ``max_tokens`` is shorter than some problems' reference replies (with their end of turn): a policy
    that answers as it was taught is then graded on cut-off replies, as wrong (the default 16 fits 2-digit sums, not a
    styled or a 9-digit sum's reply), and pass@1 drops for no reason the result shows. ``whose`` names the replies in
    the message; the warning points at the first call from outside the library."""
    from edurl.llm.sft import reply_lengths  # sft imports this module

    if not all(hasattr(p, "demonstration") for p in problems):  # a problem of a learner's own kind: no reference
        return
    lengths = reply_lengths(renderer, problems)
    cut = sum(n > max_tokens for n in lengths)
    if cut:
        warn_at_caller(
            f"max_tokens={max_tokens} cuts off {cut} of {len(problems)} of {whose} reference replies (they take up to "
            f"{max(lengths)} tokens with the end of turn), so replies like them are graded as cut off and wrong. "
            f"Pass max_tokens >= {max(lengths)} (edurl.llm.sft.reply_budget(renderer, problems) gives it for any "
            "problems)."
        )


def sequence_logprobs(
    model, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token log-probs of ``tokens[:, 1:]`` given their prefixes: shape ``(B, T-1)``.

    ``out[b, t] = log p(tokens[b, t+1] | tokens[b, :t+1])`` at ``temperature``; 0 (greedy) scores at 1, as the
    sampler reports a greedy draw's log-probs. Summing over a completion's positions gives the log-prob of the whole
    completion. ``tokens`` and ``attention_mask`` may be on any device: they are moved to the model's, and so is the
    result.
    """
    SamplingParams(max_tokens=1, temperature=temperature)  # the sampler's rules: >= 0, and none in (0, 1e-6)
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    positions = None
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
        if not bool(attention_mask.all()):
            # each row's tokens at positions 0, 1, ... from its first real token, as the sampler places them: a
            # left-padded row read at positions counted from the padding scores differently on a model with
            # absolute position embeddings (GPT-2), and by rounding on a rotary one
            positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=tokens, attention_mask=attention_mask, position_ids=positions).logits[:, :-1]
    return scaled_log_softmax(logits, temperature).gather(-1, tokens[:, 1:, None]).squeeze(-1)
