"""Peak memory of one ``forward_backward`` on a large vocabulary: the whole float32 log-softmax against the lean
path (``edurl.llm.shared_prefix.Scores``, used past ``LEAN_VOCAB`` entries), side by side from one run.

The model is one small transformer layer with Qwen2.5's vocabulary (151,936 entries), so the logits dominate, as
they do in a real checkpoint's training step. Each measurement runs in a fresh process (peak resident memory is
per process) and reports the growth of the peak over the step, per (row, token, vocabulary entry) of the
completions.

    python benchmarks/logprob_memory.py                       # bf16 and float32, 32 replies of 64 tokens
    python benchmarks/logprob_memory.py --replies 16 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from _args import positive_int  # benchmarks/ is on sys.path when a script runs

VOCAB = 151_936


def measure(dtype: str, lean: bool, replies: int, tokens: int) -> dict:
    """One forward_backward in this process; the peak resident memory's growth over it."""
    import gc
    import resource

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from edurl.llm import shared_prefix
    from edurl.llm.clients import TrainingClient
    from edurl.llm.datum import build_datum

    torch.set_num_threads(1)
    if not lean:
        shared_prefix.LEAN_VOCAB = 10**9  # the whole log-softmax, as before the lean path
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))

    class Tokenizer:
        pad_token_id = 0

    trainer = TrainingClient(model, Tokenizer())
    datums = []
    for _ in range(replies // 4):  # groups of 4 replies sharing a 16-token prompt, advantages +-1
        prompt = torch.randint(1, VOCAB, (16,)).tolist()
        for g in range(4):
            reply = torch.randint(1, VOCAB, (tokens,)).tolist()
            datums.append(build_datum(prompt, reply, [-12.0] * tokens, 1.0 if g % 2 else -1.0))
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    trainer.forward_backward(datums, "importance_sampling").result()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    return {"bytes": grown, "per_element": grown / (len(datums) * tokens * VOCAB)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replies", type=positive_int, default=32, help="replies per step, in groups of 4 (default 32)")
    ap.add_argument("--tokens", type=positive_int, default=64, help="tokens per reply (default 64)")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated weight dtypes")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: dtype,lean in a fresh process
    args = ap.parse_args()
    if args.replies % 4:
        ap.error(f"--replies must be a multiple of 4 (groups of 4), got {args.replies}")
    if args.one:
        dtype, lean = args.one.split(",")
        print(json.dumps(measure(dtype, lean == "1", args.replies, args.tokens)))
        return
    rows = []
    for dtype in args.dtypes.split(","):
        got = {}
        for lean in (False, True):
            cmd = [sys.executable, __file__, "--one", f"{dtype},{int(lean)}"]
            cmd += ["--replies", str(args.replies), "--tokens", str(args.tokens)]
            got[lean] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        rows.append((dtype, got[False], got[True]))
    print(f"forward_backward on {args.replies} replies of {args.tokens} tokens, vocabulary {VOCAB:,}: peak RSS growth")
    print(f"{'weights':<10} {'whole log-softmax':>22} {'lean (Scores)':>22} {'lean / whole':>13}")
    for dtype, whole, lean in rows:
        print(
            f"{dtype:<10} {whole['per_element']:>6.1f} B/elt ({whole['bytes'] / 1e9:5.2f} GB) "
            f"{lean['per_element']:>6.1f} B/elt ({lean['bytes'] / 1e9:5.2f} GB) {lean['bytes'] / whole['bytes']:>12.2f}x"
        )


if __name__ == "__main__":
    main()
