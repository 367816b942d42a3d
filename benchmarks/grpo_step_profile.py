"""Where a GRPO step's time goes (issue 19), on the recipe's run with 32 problems x 8 samples (the batch of the
TRL comparison, ``grpo_vs_trl.py``, and of benchmarks/README.md's tables; ``--group-size 4`` profiles the recipe's
default) from the Chapter 6 SFT checkpoint, importance_sampling, token_mean, full fine-tune, on the CPU.

The step (``edurl.llm.grpo.grpo_step``) is timed in pieces by wrapping the client methods it calls:

* fresh sampler: ``save_weights_and_get_sampling_client`` (a copy of the weights);
* decode: ``SamplingClient.sample_batch`` (prompt encoding and the decode loop, with log-probs);
* grade + datums: the rest of ``time/sample`` (parsing, grading, group advantages, building datums);
* forward_backward and optim_step: the two ``TrainingClient`` calls (``time/train`` is these and little else).

It also logs, per step, the share of sequences whose advantage is exactly 0 (the groups whose G rewards are
all equal): their gradient is 0, so a forward_backward that skipped them, keeping the denominator, would
give the same update. That share bounds what such a skip could save of forward_backward.

    python benchmarks/grpo_step_profile.py                 # seed 0, 30 steps (about a minute)
    python benchmarks/grpo_step_profile.py --steps 100 --seed 1
    python benchmarks/grpo_step_profile.py --plain-decode  # the sampler calls the model's forward every token
    python benchmarks/grpo_step_profile.py --sdpa          # forward_backward keeps sdpa attention for short rows
    python benchmarks/grpo_step_profile.py --score-zero-advantage  # score zero-advantage datums (no graph)
    python benchmarks/grpo_step_profile.py --replay-zero-advantage 3  # then A/B/C forward_backward's three modes
    python benchmarks/grpo_step_profile.py --replay-packed 3  # then A/B packed and the model's forward, 1 and 2 threads

Prints ms per step for each piece (median over the steps after the first) and the zero-advantage share over
the run. One run, one machine: compare pieces within a run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np
import torch

from edurl.llm import clients, grpo, sampling, shared_prefix
from edurl.llm.grpo import GRPOConfig, train_grpo
from edurl.utils import torch_threads

WRAPPED = {
    "fresh sampler": (clients.TrainingClient, "save_weights_and_get_sampling_client"),
    "decode": (clients.SamplingClient, "sample_batch"),
    "forward_backward": (clients.TrainingClient, "forward_backward"),
    "optim_step": (clients.TrainingClient, "optim_step"),
}


@contextmanager
def timed_methods(calls: dict[str, list[float]], recorded: list | None = None):
    """Wrap ``grpo_step`` and the methods in WRAPPED: each call made inside a step appends its seconds to
    ``calls[name]`` (the held-out evaluations decode too, outside the steps, and are left out). With ``recorded``,
    each ``forward_backward`` call also appends (trainer, a copy of its weights then, datums, args, kwargs)."""
    originals = {name: getattr(cls, attr) for name, (cls, attr) in WRAPPED.items()}
    step_fn, inside = grpo.grpo_step, [False]

    def wrap(name, fn):
        def timed(*args, **kwargs):
            if recorded is not None and name == "forward_backward" and inside[0]:
                trainer, datums, *rest = args
                weights = [p.detach().clone() for p in trainer.model.parameters()]  # about 1 ms: 650k numbers
                recorded.append((trainer, weights, list(datums), tuple(rest), dict(kwargs)))
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if inside[0]:
                calls[name].append(time.perf_counter() - t0)  # the local clients finish before returning
            return out

        return timed

    def step(*args, **kwargs):
        inside[0] = True
        try:
            return step_fn(*args, **kwargs)
        finally:
            inside[0] = False

    for name, (cls, attr) in WRAPPED.items():
        setattr(cls, attr, wrap(name, originals[name]))
    grpo.grpo_step = step
    try:
        yield
    finally:
        for name, (cls, attr) in WRAPPED.items():
            setattr(cls, attr, originals[name])
        grpo.grpo_step = step_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=8, help="completions per problem (the recipe's default: 4)")
    parser.add_argument(
        "--plain-decode",
        action="store_true",
        help="decode through the model's own forward and KV cache (sample(fast_decode=False)), not edurl.llm.decode",
    )
    parser.add_argument(
        "--score-zero-advantage",
        action="store_true",
        help="score the datums whose advantages are all 0 in a pass without a graph (GRPOConfig.score_zero_advantage)"
        ", as the recipe did until 2026-11-28, instead of not at all",
    )
    parser.add_argument(
        "--replay-zero-advantage",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="afterwards, run the steps' forward_backward calls again on the same batches and weights, alternating "
        "the three ways of treating zero-advantage datums, ROUNDS times: median ms of each",
    )
    parser.add_argument(
        "--replay-packed",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="afterwards, run the steps' forward_backward calls again on the same batches and weights with the "
        "prompts and completions packed (edurl.llm.packed) and through the model's forward (prompts, then padded "
        "completions), alternating, ROUNDS times, on 1 "
        "torch thread and on the run's: median ms of each",
    )
    parser.add_argument(
        "--sdpa",
        action="store_true",
        help="score training rows with the model's sdpa attention, not eager for short rows (short_row_attention)",
    )
    args = parser.parse_args()
    if args.sdpa:  # no row is short enough for the eager switch
        shared_prefix.EAGER_ATTENTION_MAX_TOKENS = 0
    if args.plain_decode:  # the sampler asks fast_decoder for its decode step; None means the model's forward
        sampling.fast_decoder = lambda model: None
    calls: dict[str, list[float]] = defaultdict(list)
    recorded: list = []
    # a folder of its own: the recipe's default (runs/grpo_arithmetic) may hold a learner's run
    with tempfile.TemporaryDirectory(prefix="grpo-step-profile-") as log_dir:
        config = GRPOConfig(
            seed=args.seed,
            group_size=args.group_size,
            max_steps=args.steps,
            eval_every=args.steps,
            progress=False,
            score_zero_advantage=args.score_zero_advantage,
            log_dir=log_dir,
            save_every=0,
        )
        with timed_methods(calls, recorded if args.replay_zero_advantage or args.replay_packed else None):
            result = train_grpo(config)
    m = result.metrics.dropna(subset=["time/sample"]).reset_index(drop=True)
    steps = len(m)
    per_step = {name: np.array(times) for name, times in calls.items()}
    if any(len(times) != steps for times in per_step.values()):
        raise RuntimeError(
            f"expected one call of each piece per step ({steps}), got { {k: len(v) for k, v in calls.items()} }"
        )
    per_step["grade + datums"] = m["time/sample"].to_numpy() - per_step["decode"]
    step_total = per_step["fresh sampler"] + m["time/sample"].to_numpy() + m["time/train"].to_numpy()
    later = slice(1, None)  # the first step pays one-time costs
    total = float(np.median(step_total[later]))
    print(
        f"GRPO step, the recipe ({config.batch_size} problems x {config.group_size} samples, "
        f"{config.loss_fn}, {config.aggregation}), seed {args.seed}, {steps} steps; median over steps 2-{steps}; "
        f"decode: {'the model forward per token' if args.plain_decode else 'edurl.llm.decode'}; "
        f"training attention: {'sdpa' if args.sdpa else 'eager for short rows'}; zero-advantage datums: "
        f"{'scored without a graph' if args.score_zero_advantage else 'not scored'}"
    )
    print(f"{'piece':<18} {'ms':>8} {'share':>6}")
    order = ("fresh sampler", "decode", "grade + datums", "forward_backward", "optim_step")
    for name in order:
        ms = float(np.median(per_step[name][later])) * 1e3
        print(f"{name:<18} {ms:8.1f} {ms / 1e3 / total:6.0%}")
    print(f"{'whole step':<18} {total * 1e3:8.1f}")
    zero = 1 - m["env/all/by_group/frac_mixed"].to_numpy()
    print(
        f"sequences with advantage exactly 0: median {np.median(zero):.0%} of a step "
        f"(first 10 steps {np.mean(zero[:10]):.0%}, last 10 {np.mean(zero[-10:]):.0%})"
    )
    if args.replay_zero_advantage:
        replay_zero_advantage(recorded[1:], args.replay_zero_advantage, config.num_threads)
    if args.replay_packed:
        for threads in sorted({1, config.num_threads}):
            replay_packed(recorded[1:], args.replay_packed, threads)


MODES = {  # (skip_zero_advantage, score_zero_advantage)
    "one pass with a graph over every datum": (False, True),
    "zero-advantage datums scored without a graph": (True, True),
    "zero-advantage datums not scored (the recipe)": (True, False),
}


def _replay(recorded: list, threads: int, set_mode, modes: list, rounds: int) -> dict[str, list[float]]:
    """Each recorded ``forward_backward`` call again, on its own batch and the weights it saw, in each of ``modes``
    (``set_mode(mode)`` switches to one), the modes' order turning every round: the same work per mode, so the
    medians compare like with like. Returns each mode's seconds per call."""
    times: dict[str, list[float]] = defaultdict(list)
    with torch_threads(threads):
        for r in range(rounds):
            for trainer, weights, datums, args, kwargs in recorded:
                with torch.no_grad():
                    for p, w in zip(trainer.model.parameters(), weights):
                        p.copy_(w)
                for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                    set_mode(trainer, mode)
                    trainer.model.zero_grad()
                    t0 = time.perf_counter()
                    trainer.forward_backward(datums, *args, **kwargs)
                    times[mode].append(time.perf_counter() - t0)
    return times


def _padding(recorded: list) -> list[float]:
    """For each recorded batch, the share of the padded completion pass's rows that were padding: the scored
    datums (those with a non-zero advantage) each continue their prompt with their sampled tokens after the
    first, right-padded to the longest."""
    shares = []
    for _, _, datums, _, _ in recorded:
        rest = [
            int(sum(d.loss_fn_inputs["mask"])) - 1
            for d in datums
            if any(a != 0 for a in d.loss_fn_inputs["advantages"].tolist())
        ]
        if rest and max(rest) > 0:
            shares.append(1 - sum(rest) / (len(rest) * max(rest)))
    return shares


def replay_packed(recorded: list, rounds: int, threads: int) -> None:
    """The recorded ``forward_backward`` calls packed and through the model's forward (``token_logprobs`` with and
    without its packed pass), alternating."""
    packed = shared_prefix.packed_logits
    scorers = {  # token_logprobs falls back to the model's forward when the packed pass returns None
        "model's forward (prompts, then padded completions)": lambda *args, **kwargs: None,
        "prompts and completions packed (edurl.llm.packed)": packed,
    }
    modes = list(scorers)

    def set_mode(trainer, mode):
        shared_prefix.packed_logits = scorers[mode]

    try:
        times = _replay(recorded, threads, set_mode, modes, rounds)
    finally:
        shared_prefix.packed_logits = packed
    base = float(np.median(times[modes[0]]))
    print(f"completion rows that were padding in the padded pass: median {np.median(_padding(recorded)):.0%} a step")
    print(
        f"forward_backward on the same {len(recorded)} batches, {rounds} rounds, {threads} torch thread(s), alternating:"
    )
    for mode in modes:
        ms = float(np.median(times[mode]))
        print(f"  {mode:<52} {ms * 1e3:7.1f}  {ms / base:5.2f}x")


def replay_zero_advantage(recorded: list, rounds: int, threads: int) -> None:
    """Each recorded ``forward_backward`` call again, on its own batch and the weights it saw, in each of
    MODES, the modes' order turning every round: the same work per mode, so the medians compare like with like."""
    names = list(MODES)

    def set_mode(trainer, name):
        trainer.skip_zero_advantage, trainer.score_zero_advantage = MODES[name]

    times = _replay(recorded, threads, set_mode, names, rounds)
    base = float(np.median(times[names[0]]))
    print(
        f"forward_backward on the same {len(recorded)} batches, {rounds} rounds, modes alternating "
        f"(median ms, and against one pass over every datum):"
    )
    for name in names:
        ms = float(np.median(times[name]))
        print(f"  {name:<48} {ms * 1e3:7.1f}  {ms / base:5.2f}x")


if __name__ == "__main__":
    main()
