"""Sampler throughput: ``edurl.llm.sample`` vs ``model.generate`` on the same batch (Chapter 6).

The batch is what a GRPO step samples: P prompts x G samples each, temperature 1, top_p 1,
stopping at ``<|im_end|>``. Both samplers run the same model, in the same process, on the
same prompts, and the table reports generated tokens per second (stop token included, padding
excluded) with edurl's ratio over each peer variant. ``generate`` gets the P*G rows already
repeated, since it has no "prefill once, sample G times" mode; the "+ log-probs" variant also
asks it for the scores an RL trainer needs (``compute_transition_scores``). The "model forward per token" row
is edurl's sampler with ``fast_decode=False``: the same draws, with the model's own forward and KV cache at every
decode step instead of :mod:`edurl.llm.decode` (a group's prompt kept once, completions in reserved buffers).

    python benchmarks/sampler.py                       # the SFT checkpoint of Chapter 6 (trained once, cached)
    python benchmarks/sampler.py --random-init         # no SFT: every row runs to max_tokens
    python benchmarks/sampler.py --device cuda --prompts 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import pandas as pd
import torch

from edurl import llm


def edurl_sample(model, prompts, G, max_tokens, stop, pad_id, seed, fast_decode=True):
    params = llm.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=stop, seed=seed)
    out = llm.sample(model, prompts, G, params, pad_token_id=pad_id, fast_decode=fast_decode)
    return sum(len(c.tokens) for c in out)


def hf_generate(model, prompts, G, max_tokens, stop, pad_id, seed, with_logprobs):
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompts], device=device).repeat_interleave(G, 0)
    mask = torch.arange(L, device=device) >= torch.tensor([L - len(p) for p in prompts], device=device)[:, None]
    mask = mask.long().repeat_interleave(G, 0)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_tokens,
        eos_token_id=stop,
        pad_token_id=pad_id,
        return_dict_in_generate=True,
        output_scores=with_logprobs,
    )
    new = out.sequences[:, L:]  # (P*G, <= max_tokens)
    if with_logprobs:
        model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    # tokens up to and including the first stop token (generate pads finished rows)
    is_stop = torch.isin(new, torch.tensor(stop, device=device))
    first = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, torch.full_like(new[:, 0], new.shape[1]))
    return int(first.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random-init", action="store_true", help="skip SFT; use a randomly initialised tiny LM")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.random_init:
        tok = llm.build_char_tokenizer()
        model = llm.build_tiny_lm(tok)
    else:
        model, tok, _, _ = llm.load_or_train_sft()
    model.to(args.device).eval()
    renderer = llm.ChatMLRenderer(tok)
    problems = llm.ArithmeticTask().sample(args.prompts, split="test", seed=0)
    prompts = [renderer.build_generation_prompt(p.messages()) for p in problems]
    stop = renderer.get_stop_sequences()
    common = (model, prompts, args.samples, args.max_tokens, stop, tok.pad_token_id)
    runs = {
        "edurl.llm.sample (with log-probs)": lambda seed: edurl_sample(*common, seed),
        "edurl.llm.sample, model forward per token": lambda seed: edurl_sample(*common, seed, fast_decode=False),
        "model.generate": lambda seed: hf_generate(*common, seed, with_logprobs=False),
        "model.generate + log-probs": lambda seed: hf_generate(*common, seed, with_logprobs=True),
    }
    for run in runs.values():  # warm-up: lazy imports, allocator
        run(0)
    rows = []
    for name, run in runs.items():
        times, tokens = [], []
        for r in range(args.repeats):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens.append(run(r + 1))
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        sec = statistics.median(times)
        rows.append(
            {
                "sampler": name,
                "seconds": sec,
                "tokens": statistics.median(tokens),
                "tokens/s": statistics.median(t / s for t, s in zip(tokens, times)),
            }
        )
    df = pd.DataFrame(rows).set_index("sampler")
    df["edurl speed-up"] = df.loc["edurl.llm.sample (with log-probs)", "tokens/s"] / df["tokens/s"]
    print(
        f"\n{args.prompts} prompts x {args.samples} samples, max_tokens={args.max_tokens}, device={args.device}, "
        f"threads={args.threads}, {'random init' if args.random_init else 'SFT checkpoint'}, "
        f"median of {args.repeats}"
    )
    print(df.to_string(float_format=lambda x: f"{x:,.2f}"))


if __name__ == "__main__":
    main()
