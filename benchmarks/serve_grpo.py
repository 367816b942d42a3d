"""Does GRPO learn through the tinker SDK and edurl.serve as it does in process? The same runs, both ways, over seeds.

For each seed, two GRPO runs from the same warm start (Chapter 6's SFT checkpoint, ``edurl/tiny-arithmetic``),
with a rank-8 LoRA, on the same problems and the same held-out test set:

- **in process**: ``train_grpo`` with ``sample_per_problem=True`` and ``aggregation="sum"`` (Tinker's sum);
- **HTTP**: ``edurl.recipes.tinker_rl_loop``, written against the official SDK, against ``python -m edurl.serve``.

Both draw step ``s``'s problems and every group's sampling seed from ``(seed, s)`` the same way, and both use
Adam with the same settings and gradient clipping. What differs is the code around them (two loops, the LoRA
initialisation's random stream) and float rounding, so the runs are not identical: the comparison is the
held-out gain (greedy pass@1 at the end minus at the start) over seeds.

    python benchmarks/serve_grpo.py                        # 5 seeds x 40 steps, P = 32, G = 8: ~10 min on 2 cores
    python benchmarks/serve_grpo.py --seeds 0 1 2 --steps 20 --plot runs/serve_grpo.png

Prints one row per seed and run, then the median (min-max) gain of each, and the paired difference
(HTTP - in process) with its standard error over seeds.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from _args import seed_list, seed_lists  # benchmarks/ is on sys.path when a script runs

from edurl import load_metrics
from edurl.llm.grpo import GRPOConfig, train_grpo
from edurl.llm.sft import SFTConfig, load_or_train_sft
from edurl.recipes import tinker_rl_loop
from edurl.serve.launch import LocalServer

KEY = "tml-serve-grpo"


def curve(log_dir: Path) -> tuple[list[int], list[float]]:
    """Held-out pass@1 against steps done, from a metrics.jsonl that either loop wrote (they log alike)."""
    metrics = load_metrics(log_dir)
    rows = metrics.dropna(subset=["test/pass_at_1"])
    start = float(metrics["test/start_pass_at_1"].dropna().iloc[0])
    return [0, *(int(s) + 1 for s in rows["step"])], [start, *(float(v) for v in rows["test/pass_at_1"])]


def run_in_process(args, seed: int, base_model: str, log_dir: Path):
    config = GRPOConfig(
        base_model=base_model,
        lora_rank=8,
        aggregation="sum",
        sample_per_problem=True,
        batch_size=args.problems,
        group_size=args.group,
        max_steps=args.steps,
        learning_rate=args.lr,
        max_tokens=16,
        eval_every=args.eval_every,
        num_eval=args.num_eval,
        seed=seed,
        num_threads=args.threads,
        device="cpu",
        progress=False,
        log_dir=str(log_dir),
    )
    train_grpo(config)
    return curve(log_dir)


def run_http(args, seed: int, url: str, log_dir: Path):
    argv = ["--base-url", url, "--batch-size", str(args.problems), "--group-size", str(args.group)]
    argv += ["--max-steps", str(args.steps), "--learning-rate", str(args.lr), "--eval-every", str(args.eval_every)]
    argv += ["--num-eval", str(args.num_eval), "--seed", str(seed), "--log-dir", str(log_dir), "--no-progress"]
    tinker_rl_loop.main(argv)
    return curve(log_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=seed_list, nargs="+", default=[[0, 1, 2, 3, 4]], help="seeds: 0 1 2 or 0,1,2")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--num-eval", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, in process and in the server")
    parser.add_argument("--plot", default=None, help="save the held-out curves of every run to this PNG")
    args = parser.parse_args()
    args.seeds = seed_lists(parser, args.seeds)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ["TINKER_API_KEY"] = KEY
    os.environ["EDURL_MAX_THREADS"] = str(args.threads)

    base_model = str(load_or_train_sft(SFTConfig(), progress=False)[3])  # the folder edurl/tiny-arithmetic names
    curves, seconds = {}, {}
    with tempfile.TemporaryDirectory() as tmp, LocalServer(device="cpu", api_key=KEY) as server:
        for seed in args.seeds:
            for name, slug, fn, where in (
                ("in process", "in_process", run_in_process, base_model),
                ("HTTP (tinker SDK + edurl.serve)", "http", run_http, server.url),
            ):
                t0 = time.perf_counter()
                curves[name, seed] = fn(args, seed, where, Path(tmp) / f"{slug}_{seed}")
                seconds[name, seed] = time.perf_counter() - t0
                steps, values = curves[name, seed]
                print(
                    f"seed {seed}  {name:<32} pass@1 {values[0]:.3f} -> {values[-1]:.3f} "
                    f"(gain {values[-1] - values[0]:+.3f}) in {seconds[name, seed]:.0f} s",
                    flush=True,
                )

    names = ["in process", "HTTP (tinker SDK + edurl.serve)"]
    gains = {n: [curves[n, s][1][-1] - curves[n, s][1][0] for s in args.seeds] for n in names}
    print(
        f"\nheld-out greedy pass@1 gain after {args.steps} steps ({args.num_eval} test problems; "
        f"P = {args.problems}, G = {args.group}, lr {args.lr}; {len(args.seeds)} seeds; median (min-max))"
    )
    print(f"{'path':<32} {'gain':>7} {'min-max':>16} {'s/run':>7}")
    for n in names:
        g = gains[n]
        run_s = statistics.median(seconds[n, s] for s in args.seeds)
        print(f"{n:<32} {statistics.median(g):+7.3f} {min(g):+7.3f}..{max(g):+7.3f} {run_s:7.0f}")
    diff = [h - i for h, i in zip(gains[names[1]], gains[names[0]])]
    se = statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")
    print(
        f"paired difference (HTTP - in process): mean {statistics.mean(diff):+.3f}, standard error {se:.3f}, "
        f"min-max {min(diff):+.3f}..{max(diff):+.3f}"
    )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for (n, _seed), (steps, values) in curves.items():
            ax.plot(steps, values, color="C0" if n == names[0] else "C1", alpha=0.6, label=n)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys())
        ax.set(xlabel="GRPO step", ylabel="held-out pass@1 (greedy)", title="GRPO in process and through HTTP")
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110, bbox_inches="tight")
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
