"""The cost of a sampler snapshot (``TrainingClient.save_weights_and_get_sampling_client``) for a LoRA run on a
Qwen2.5-0.5B-shaped model (random weights, vocabulary 151,936, hidden 896, ``--layers`` of its 24), side by side in
one run: a copy of the whole model (how the snapshot was taken until 2026-11-30) against edurl's, which copies the
adapter and shares the frozen base. Median milliseconds over ``--repeats`` alternating calls, and the bytes each
snapshot holds of its own.

    python benchmarks/snapshot_cost.py                 # 4 layers, rank 16
    python benchmarks/snapshot_cost.py --layers 24     # the real depth: about 2 GB of float32 weights per copy
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

from _args import positive_int  # benchmarks/ is on sys.path when a script runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--rank", type=positive_int, default=16)
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--threads", type=positive_int, default=2)
    args = parser.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from edurl.llm.clients import TrainingClient
    from edurl.llm.policy import LoraSettings, wrap_lora
    from edurl.llm.tokenizer import build_char_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=args.layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = wrap_lora(Qwen2ForCausalLM(config), LoraSettings(rank=args.rank))
    trainer = TrainingClient(model, build_char_tokenizer())
    params = list(model.parameters())

    def whole_copy():
        snapshot = copy.deepcopy(trainer.model).eval()
        for q in snapshot.parameters():
            q.requires_grad_(False)
        return snapshot

    def edurl_snapshot():
        return trainer.save_weights_and_get_sampling_client("s").model

    def own_bytes(snapshot) -> int:
        mine = {p.data_ptr() for p in params}
        return sum(q.numel() * q.element_size() for q in snapshot.parameters() if q.data_ptr() not in mine)

    arms = {"whole copy": whole_copy, "edurl (adapter copied, base shared)": edurl_snapshot}
    times = {name: [] for name in arms}
    held = {}
    for _ in range(args.repeats):
        for name, take in arms.items():
            start = time.perf_counter()
            snapshot = take()
            times[name].append(time.perf_counter() - start)
            held[name] = own_bytes(snapshot)
            del snapshot
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    print(
        f"Qwen2.5-0.5B shapes, {args.layers} layers: {total / 1e6:.0f}M parameters, {trained / 1e6:.2f}M of them "
        f"LoRA (rank {args.rank}); {args.threads} threads, median of {args.repeats} alternating calls\n"
    )
    print("| snapshot | ms | MB of its own |")
    print("|---|---|---|")
    base = statistics.median(times["whole copy"])
    for name in arms:
        ms = statistics.median(times[name]) * 1000
        print(f"| {name} | {ms:.1f} | {held[name] / 2**20:.1f} |")
    print(f"\nedurl / whole copy: {statistics.median(times[list(arms)[1]]) / base:.3f}x the time")


if __name__ == "__main__":
    main()
