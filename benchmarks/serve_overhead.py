"""What HTTP costs: one GRPO-shaped step in process, and the same step through the tinker SDK and edurl.serve.

Both sides run the same step on the same problems, from the same SFT checkpoint with a rank-8 LoRA:
sample G completions for each of P problems, grade them, centre the rewards per group, build the datums, one
``forward_backward`` (importance_sampling) and one ``optim_step``. In process, the P prompts go to
``SamplingClient.sample_batch`` in one call (what edurl's loop does). Through HTTP, the SDK sends one sample
request per prompt, as Tinker code does, all in flight at once; the server batches the ones that queue up.

    python benchmarks/serve_overhead.py                 # 6 steps each, P = 32, G = 8
    python benchmarks/serve_overhead.py --steps 10 --problems 16

Prints seconds per step (the median over the steps after the first, which warms caches up) and the ratio
HTTP / in process, from one run on one machine. The server runs in a subprocess on a free localhost port.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from _args import positive_int  # benchmarks/ is on sys.path when a script runs

from edurl.llm import ChatMLRenderer
from edurl.llm.clients import AdamParams, ServiceClient
from edurl.llm.datum import build_datum
from edurl.llm.rewards import grade
from edurl.llm.sampling import SamplingParams
from edurl.llm.sft import load_or_train_sft
from edurl.llm.tasks import ArithmeticTask
from edurl.recipes.tinker_rl_loop import make_datum
from edurl.serve.launch import LocalServer

KEY = "tml-serve-overhead"
LR = 1e-4


def problems_for(step: int, n: int):
    return ArithmeticTask(num_digits=2).sample(n, split="train", seed=1000 + step)


def advantages(rewards: list[list[float]]) -> list[list[float]]:
    out = []
    for row in rewards:
        mean = sum(row) / len(row)
        out.append([r - mean for r in row])
    return out


def rewards_of(renderer, problems, completions) -> list[list[float]]:
    rows = []
    for problem, group in zip(problems, completions):
        row = []
        for seq in group:
            message, ok = renderer.parse_response(list(seq.tokens), seq.stop_reason)
            row.append(grade(message["content"], problem.answer, complete=ok).reward)
        rows.append(row)
    return rows


def in_process_step(tc, renderer, problems, group: int, max_tokens: int) -> float:
    start = time.perf_counter()
    prompts = [renderer.build_generation_prompt(p.messages()) for p in problems]
    sampler = tc.save_weights_and_get_sampling_client()
    responses = sampler.sample_batch(prompts, group, SamplingParams(max_tokens=max_tokens, temperature=1.0))
    seqs = [[s for s in r.sequences] for r in responses]
    adv = advantages(rewards_of(renderer, problems, seqs))
    datums = [
        build_datum(prompt, s.tokens, s.logprobs, a)
        for prompt, g, row in zip(prompts, seqs, adv)
        for s, a in zip(g, row)
    ]
    tc.forward_backward(datums, "importance_sampling").result()
    tc.optim_step(AdamParams(learning_rate=LR)).result()
    return time.perf_counter() - start


def http_step(tc, renderer, problems, group: int, max_tokens: int) -> float:
    from tinker import types

    start = time.perf_counter()
    prompts = [renderer.build_generation_prompt(p.messages()) for p in problems]
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    futures = [sampler.sample(types.ModelInput.from_ints(p), group, params) for p in prompts]
    seqs = [f.result().sequences for f in futures]
    adv = advantages(rewards_of(renderer, problems, seqs))
    datums = [
        make_datum(prompt, list(s.tokens), list(s.logprobs), a)
        for prompt, g, row in zip(prompts, seqs, adv)
        for s, a in zip(g, row)
    ]
    tc.forward_backward(datums, loss_fn="importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=LR, eps=1e-8, grad_clip_norm=1.0)).result()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=6)
    parser.add_argument("--problems", type=positive_int, default=32)
    parser.add_argument("--group", type=positive_int, default=8)
    parser.add_argument("--max-tokens", type=positive_int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker

    model, tokenizer, _, _ = load_or_train_sft(progress=False)
    renderer = ChatMLRenderer(tokenizer)
    torch.manual_seed(0)
    local = ServiceClient(device="cpu").create_lora_training_client((model, tokenizer), rank=8)
    server = LocalServer(device="cpu", api_key=KEY).start()
    try:
        remote = (
            tinker.ServiceClient(base_url=server.url, api_key=KEY)
            .create_lora_training_client(base_model="edurl/tiny-arithmetic", rank=8)
            .result()
        )
        times = {"in process": [], "HTTP (tinker SDK + edurl.serve)": []}
        for step in range(args.steps):  # alternate, so that both see the same machine state
            problems = problems_for(step, args.problems)
            times["in process"].append(in_process_step(local, renderer, problems, args.group, args.max_tokens))
            times["HTTP (tinker SDK + edurl.serve)"].append(
                http_step(remote, renderer, problems, args.group, args.max_tokens)
            )
    finally:
        server.stop()
    med = {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in times.items()}
    base = med["in process"]
    print(
        f"\nGRPO-shaped step, P = {args.problems} problems x G = {args.group}, max_tokens = {args.max_tokens}, "
        f"{args.steps} steps (median of steps 2..{args.steps}; s/step, min-max in brackets)"
    )
    print(f"{'path':<34} {'s/step':>8}  {'min-max':>15}  {'x in process':>12}")
    for name, values in times.items():
        rest = values[1:] if len(values) > 1 else values
        print(f"{name:<34} {med[name]:8.3f}  {min(rest):6.3f}-{max(rest):<7.3f}  {med[name] / base:12.2f}")


if __name__ == "__main__":
    main()
