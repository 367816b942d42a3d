"""Temperature: how it reshapes one next-token distribution, and what it does to a group (Chapter 6).

Sampling at temperature ``T`` draws from ``softmax(logits / T)``. ``T -> 0`` is
greedy decoding; ``T = 1`` is the model's own distribution; ``T > 1`` flattens it.
GRPO learns from differences *within* a group of samples for the same prompt, so
a group that always says the same thing (low ``T``) has zero advantage
everywhere and teaches nothing. ``group_diversity`` measures that directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import pandas as pd
import torch
from tqdm.auto import tqdm

from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.rewards import extract_boxed, grade
from edurl.llm.sampling import SamplingParams, sample
from edurl.llm.tasks import Problem


@torch.no_grad()
def next_token_distribution(model, prompt_ids: Sequence[int], temperature: float = 1.0) -> torch.Tensor:
    """``softmax(logits / temperature)`` for the token after ``prompt_ids``: shape ``(V,)``.
    ``temperature = 0`` returns the greedy one-hot distribution."""
    SamplingParams(max_tokens=1, temperature=temperature)  # the sampler's rules: >= 0 (a negative one inverted the
    # distribution), and none in (0, 1e-6), where logits / temperature overflow
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: the next token is predicted from at least one token (e.g. a BOS)")
    logits = model(input_ids=torch.tensor([list(prompt_ids)], device=model.device)).logits[0, -1].float().cpu()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def plot_next_token_distribution(probs: torch.Tensor, tokenizer, top_k: int = 12, ax=None, title: str = ""):
    """Bar chart of the ``top_k`` most likely next tokens."""
    ax = ax or plt.subplots(figsize=(6, 3))[1]
    p, idx = probs.topk(top_k)
    labels = [repr(tokenizer.convert_ids_to_tokens(int(i))).strip("'") for i in idx]
    ax.bar(range(top_k), p.numpy(), color="tab:blue")
    ax.set_xticks(range(top_k), labels)
    ax.set_ylim(0, 1)
    ax.set_ylabel("probability")
    ax.set_title(title or f"entropy {-(probs * probs.clamp_min(1e-12).log()).sum():.2f} nats")
    return ax


def group_diversity(
    model,
    renderer: ChatMLRenderer,
    problems: Sequence[Problem],
    temperatures: Sequence[float],
    group_size: int = 8,
    max_tokens: int = 16,
    seed: int = 0,
    progress: bool = True,
) -> pd.DataFrame:
    """Sample a group of ``group_size`` replies per problem at each temperature and measure the group.

    One row per temperature with the means over problems of:
    ``distinct_answers`` (different boxed answers in a group, a missing box counts as one answer),
    ``correct`` (share of replies graded correct), and ``frac_mixed`` (share of groups with both a
    correct and a wrong reply, the groups whose advantages teach the answer; a group whose wrong replies differ
    only in format gets small advantages too, and GRPO's ``env/all/by_group/frac_mixed`` counts every group whose
    rewards differ).
    """
    prompts = [renderer.build_generation_prompt(p.messages()) for p in problems]
    rows = []
    for temperature in tqdm(temperatures, desc="temperatures", disable=not progress):
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed, stop=renderer.get_stop_sequences()
        )
        out = sample(model, prompts, group_size, params, pad_token_id=renderer.tokenizer.pad_token_id)
        distinct, mixed, correct = [], [], []
        for i, problem in enumerate(problems):
            replies = [
                renderer.parse_response(c.tokens, c.stop_reason) for c in out[i * group_size : (i + 1) * group_size]
            ]
            grades = [grade(m["content"], problem.answer, complete=ok).correct for m, ok in replies]
            distinct.append(len({extract_boxed(m["content"]) for m, _ in replies}))
            mixed.append(0.0 < sum(grades) < group_size)
            correct.append(sum(grades) / group_size)
        rows.append(
            {
                "temperature": temperature,
                "distinct_answers": sum(distinct) / len(problems),
                "correct": sum(correct) / len(problems),
                "frac_mixed": sum(mixed) / len(problems),
            }
        )
    return pd.DataFrame(rows)


def plot_group_diversity(table: pd.DataFrame, group_size: int = 8):
    """Distinct answers per group and the share of mixed groups, against temperature."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    left.plot(table["temperature"], table["distinct_answers"], "o-")
    left.axhline(1, color="gray", lw=0.8, ls="--")
    left.set(xlabel="temperature", ylabel=f"distinct answers in a group of {group_size}", ylim=(0, group_size))
    right.plot(table["temperature"], table["frac_mixed"], "o-", color="tab:green", label="frac_mixed")
    right.plot(table["temperature"], table["correct"], "s--", color="tab:orange", label="correct")
    right.set(xlabel="temperature", ylabel="fraction", ylim=(0, 1))
    right.legend()
    fig.tight_layout()
    return fig
