"""Eager against sdpa attention in the training client's shared-prefix scoring, by row length (issue 19).

``TrainingClient.forward_backward`` scores a GRPO batch with :func:`edurl.llm.shared_prefix.token_logprobs`: each
distinct prompt runs once, left-padded, and every completion then reads its prompt's keys and values through an
attention mask that the prompts' different lengths make irregular. On the CPU, for short rows, transformers' eager
attention (two matrix products and a softmax) ran that forward and backward faster than the fused ``sdpa`` kernel;
for long rows, slower. :data:`edurl.llm.shared_prefix.EAGER_ATTENTION_MAX_TOKENS` is the row length up to which the
training client switches to eager (:func:`edurl.llm.shared_prefix.short_row_attention`); this script is where that
number comes from. It times eager at every length, past that limit too.

For each model size and (prompt length, completion length), P prompts x G completions with prompt lengths drawn
from 3/4 to all of the prompt length and completion lengths from 1/2 to all of theirs, random weights and tokens,
float32: the best of ``--repeats`` rounds (each the mean of 3 forward + backward passes) for sdpa and for eager,
alternating, and eager's time over sdpa's.

    python benchmarks/short_row_attention.py
    python benchmarks/short_row_attention.py --repeats 5 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch
from _args import positive_int  # benchmarks/ is on sys.path when a script runs
from tqdm.auto import tqdm

from edurl.llm import shared_prefix
from edurl.llm.clients import disable_dropout
from edurl.llm.model import TinyLMConfig, build_tiny_lm
from edurl.llm.shared_prefix import token_logprobs
from edurl.llm.tokenizer import build_char_tokenizer

MODELS = {
    "tiny (the course's, hidden 128)": TinyLMConfig(max_position_embeddings=1024),
    "hidden 256, 4 layers": TinyLMConfig(
        hidden_size=256, num_layers=4, intermediate_size=768, max_position_embeddings=1024
    ),
}
SHAPES = ((32, 8, 26, 11), (32, 8, 32, 14), (32, 8, 48, 16), (16, 8, 64, 64), (8, 8, 128, 128))
"""(P prompts, G completions each, prompt length, completion length); the first is the GRPO recipe's batch."""


def shared_prefix_batch(P: int, G: int, Lp: int, Lr: int, vocab: int, generator: torch.Generator):
    """Right-padded (B, T) ids, attention mask, targets and loss mask: G rows per prompt, grouped."""
    B, T = P * G, Lp + Lr
    plens = torch.randint(Lp * 3 // 4, Lp + 1, (P,), generator=generator).repeat_interleave(G)
    prompts = torch.randint(1, vocab, (P, Lp), generator=generator).repeat_interleave(G, 0)
    rest = torch.randint(1, vocab, (B, Lr), generator=generator)
    rlens = torch.randint(Lr // 2, Lr + 1, (B,), generator=generator)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    for b in range(B):
        pl, rl = int(plens[b]), int(rlens[b])
        ids[b, :pl], ids[b, pl : pl + rl] = prompts[b, :pl], rest[b, :rl]
        attn[b, : pl + rl] = 1
        mask[b, pl - 1 : pl + rl - 1] = 1  # the positions whose targets are completion tokens
    return ids, attn, torch.roll(ids, -1, 1) * attn, mask


def seconds(model, batch, eager: bool) -> float:
    """Mean wall time of 3 forward + backward passes of the shared-prefix scoring."""
    ids, attn, targets, mask = batch
    t0 = time.perf_counter()
    for _ in range(3):
        lp, _ = token_logprobs(
            model, ids, attn, targets, mask, with_entropy=True, model_config=model.config, eager_short_rows=eager
        )
        (lp * mask).sum().backward()
    return (time.perf_counter() - t0) / 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--repeats", type=positive_int, default=3, help="alternating rounds per arm; the best one is kept"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    limit = shared_prefix.EAGER_ATTENTION_MAX_TOKENS
    shared_prefix.EAGER_ATTENTION_MAX_TOKENS = 10**9  # time eager at every length, not only where the client uses it
    tokenizer = build_char_tokenizer()
    rows = []
    with tqdm(total=len(MODELS) * len(SHAPES), desc="shapes") as bar:
        for name, config in MODELS.items():
            model = disable_dropout(build_tiny_lm(tokenizer, config, seed=0)).train()
            for P, G, Lp, Lr in SHAPES:
                batch = shared_prefix_batch(P, G, Lp, Lr, len(tokenizer), torch.Generator().manual_seed(0))
                best = {True: float("inf"), False: float("inf")}
                for _ in range(args.repeats):
                    for eager in (False, True):
                        best[eager] = min(best[eager], seconds(model, batch, eager))
                model.zero_grad()
                rows.append((name, P, G, Lp, Lr, best[False], best[True]))
                bar.update()
    print(
        f"shared-prefix scoring, forward + backward, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"the training client switches to eager up to {limit} tokens a row"
    )
    print(f"{'model':<32} {'P x G':>7} {'prompt':>6} {'reply':>5} {'sdpa ms':>8} {'eager ms':>9} {'eager/sdpa':>10}")
    for name, P, G, Lp, Lr, sdpa, eager in rows:
        print(f"{name:<32} {f'{P}x{G}':>7} {Lp:>6} {Lr:>5} {sdpa * 1e3:8.1f} {eager * 1e3:9.1f} {eager / sdpa:10.2f}")


if __name__ == "__main__":
    main()
