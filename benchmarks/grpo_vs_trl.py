"""GRPO step time and accuracy gain: edurl's ``grpo_step`` vs TRL's ``GRPOTrainer``, same run, CPU (Chapter 7).

Both libraries start from the same SFT checkpoint of Chapter 6 and train it on the same arithmetic problems
(2-digit addition) with the same reward, ``edurl.llm.grade``. The settings are matched one by one:

=======================  ===========================================  ============================================
setting                  edurl (``edurl.llm.grpo.GRPOConfig``)        TRL 1.16 (``trl.GRPOConfig``)
=======================  ===========================================  ============================================
problems per step        ``batch_size=32``                            ``per_device_train_batch_size=256``: it counts
                                                                      completions, so 256 / 8 = 32 prompts, and
                                                                      ``generation_batch_size`` becomes 256
completions per problem  ``group_size=8``                             ``num_generations=8``
optimizer steps / batch  ``num_substeps=1``                           ``gradient_accumulation_steps=1``,
                                                                      ``steps_per_generation=1``,
                                                                      ``num_iterations=1``
loss                     ``loss_fn="ppo"``, clip [0.8, 1.2]           ``loss_type="dapo"``, ``epsilon=0.2``
aggregation              ``aggregation="token_mean"``                 ``"dapo"``: sum over the batch's completion
                                                                      tokens / their number
advantages               ``advantage_scale="none"`` (R - mean)        ``scale_rewards="none"``
KL penalty               ``kl_coef=0``                                ``beta=0`` (no reference model)
sampling                 temperature 1, top_p 1, ``max_tokens=16``,   ``temperature=1``, ``top_p=1``, ``top_k=0``,
                         stop at ``<|im_end|>``                       ``max_completion_length=16``, eos
                                                                      ``<|im_end|>`` (checked)
optimizer                AdamW(0.9, 0.95, eps 1e-8, wd 0), clip the   ``optim="adamw_torch"``, the same betas, eps,
                         grad norm to 1, constant lr                  wd, ``max_grad_norm=1``,
                                                                      ``lr_scheduler_type="constant"``
precision, device        float32, CPU                                 ``use_cpu=True``, ``bf16=False``, no vLLM,
                                                                      ``activation_checkpointing=False`` (checked)
prompt tokens            ``ChatMLRenderer.build_generation_prompt``   the tokenizer's chat template (checked equal)
problem order            ``task.sample(32, seed=f(seed, step))``      the same problems in the same order
                                                                      (``shuffle_dataset=False``)
=======================  ===========================================  ============================================

The reward is ``grade(text, answer, complete).reward`` in both. TRL hands its reward function the decoded
completion text (special tokens skipped) and ``completion_ids`` (cut after the first ``<|im_end|>``), so a reply
that ran to 16 tokens without ``<|im_end|>`` is graded incomplete, as edurl grades it.

Differences that remain, by design of each library: edurl encodes each prompt once and samples its 8 completions
from one KV cache, TRL's ``generate`` encodes each prompt 8 times; edurl snapshots the weights into a sampler each
step; TRL computes log-probs with a fused, tiled LM head. With one optimizer step per batch the ratio is 1 in both
(TRL divides by its own detached log-probs, edurl by the sampler's, equal up to float error), so the two losses
have the same gradient, -A * grad log pi averaged over the batch's tokens. In a group whose rewards are all equal
edurl sets the advantages to exactly 0, TRL computes R - mean (0 up to rounding). The two libraries draw their
samples from different random streams, so their accuracy gains differ by sampling noise: compare them over seeds.

Timing: seconds per step is the median over steps after the first (edurl: one ``grpo_step`` call; TRL: from
``on_step_begin`` to ``on_step_end``, i.e. generation, reward, forward/backward, clip and optimizer step). Total
seconds is building the trainer plus all steps, without the two held-out evaluations. Both libraries first run
two untimed steps (see ``warm_up``). The numbers mean something only on an otherwise idle CPU. Held-out pass@1 is
greedy, on the same 200 test problems, with ``edurl.llm.evaluate`` for both models, before and after training;
train reward is the mean reward of the sampled completions at the first and at the last step.

    python benchmarks/grpo_vs_trl.py                 # 100 steps each, seed 0, 2 threads
    python benchmarks/grpo_vs_trl.py --smoke         # 3 steps each: does it run end to end?
    python benchmarks/grpo_vs_trl.py --steps 200 --seeds 0,1,2 --threads 4
"""

from __future__ import annotations

import os

# TRL and transformers must never reach the Hub: the model, tokenizer and data are all local.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ[_var] = "1"

import argparse
import statistics
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch
import transformers
from _args import seed_list  # benchmarks/ is on sys.path when a script runs

from edurl import llm
from edurl.llm.clients import AdamParams
from edurl.llm.grpo import GRPOConfig, grpo_step, make_training_client, problem_seed

GROUP_SIZE = 8
BATCH_SIZE = 32
MAX_TOKENS = 16
CLIP_EPS = 0.2
NUM_TEST = 200


def edurl_config(seed: int, steps: int, lr: float, threads: int, log_dir: str) -> GRPOConfig:
    """edurl's side of the table in the module docstring."""
    return GRPOConfig(
        seed=seed,
        group_size=GROUP_SIZE,
        batch_size=BATCH_SIZE,
        max_steps=steps,
        learning_rate=lr,
        loss_fn="ppo",
        clip_low_threshold=1 - CLIP_EPS,
        clip_high_threshold=1 + CLIP_EPS,
        aggregation="token_mean",
        advantage_scale="none",
        num_substeps=1,
        kl_coef=0.0,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        num_eval=NUM_TEST,
        num_threads=threads,
        progress=False,
        log_dir=log_dir,
    )


def train_problems(config: GRPOConfig) -> list[list[llm.Problem]]:
    """The problems ``grpo_step`` draws at each step, so TRL can be fed the same ones in the same order."""
    task = config.sft.task()
    return [
        task.sample(config.batch_size, split="train", seed=problem_seed(config.seed, step))
        for step in range(config.max_steps)
    ]


def summarize(name, seed, step_times, total, before, after, rewards) -> dict:
    timed = step_times[1:] or step_times  # the first step pays one-time costs (lazy imports, allocator)
    return {
        "library": name,
        "seed": seed,
        "steps": len(step_times),
        "s/step": statistics.median(timed),
        "total s": total,
        "pass@1 before": before.pass_at_1,
        "pass@1 after": after.pass_at_1,
        "gain": after.pass_at_1 - before.pass_at_1,
        "train reward (first)": rewards[0],
        "train reward (last)": rewards[-1],
    }


def print_row(row: dict) -> None:
    print("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


# ---------------------------------------------------------------- edurl


def run_edurl(config: GRPOConfig, test: list[llm.Problem]) -> dict:
    t0 = time.perf_counter()
    trainer, renderer, task = make_training_client(config)
    setup = time.perf_counter() - t0
    before = llm.evaluate(trainer.model, renderer, test)
    stop = renderer.get_stop_sequences()
    step_times, rewards = [], []
    for step in range(config.max_steps):
        t = time.perf_counter()
        row, _ = grpo_step(config, trainer, renderer, task, step, stop)
        step_times.append(time.perf_counter() - t)
        rewards.append(row["env/all/reward/total"])
    total = setup + sum(step_times)
    after = llm.evaluate(trainer.model, renderer, test)
    return summarize("edurl", config.seed, step_times, total, before, after, rewards)


# ---------------------------------------------------------------- TRL


def trl_args(config: GRPOConfig, output_dir: str):
    """TRL's side of the table in the module docstring."""
    import trl

    adam = AdamParams(learning_rate=config.learning_rate)  # the optimizer settings grpo_step uses
    return trl.GRPOConfig(
        output_dir=output_dir,
        seed=config.seed,
        max_steps=config.max_steps,
        num_train_epochs=1,
        # 32 prompts x 8 completions per optimizer step: the batch size counts completions, not prompts
        per_device_train_batch_size=config.batch_size * config.group_size,
        num_generations=config.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        shuffle_dataset=False,
        loss_type="dapo",
        epsilon=CLIP_EPS,
        scale_rewards="none",
        beta=0.0,
        mask_truncated_completions=False,
        temperature=config.temperature,
        top_p=1.0,
        top_k=0,
        max_completion_length=config.max_tokens,
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=adam.beta1,
        adam_beta2=adam.beta2,
        adam_epsilon=adam.eps,
        weight_decay=adam.weight_decay,
        max_grad_norm=adam.grad_clip_norm,
        # CPU, float32, nothing GPU-only: TRL's defaults are bf16=True and gradient (activation) checkpointing on
        use_cpu=True,
        bf16=False,
        fp16=False,
        use_vllm=False,
        activation_checkpointing=False,
        dataloader_pin_memory=False,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
    )


def check_chat_template(tokenizer, renderer: llm.ChatMLRenderer, problems: list[llm.Problem]) -> None:
    """TRL renders prompts with the tokenizer's chat template; it must give our renderer's tokens."""
    for p in problems:
        theirs = tokenizer.apply_chat_template(
            [p.messages()], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"][0]
        ours = renderer.build_generation_prompt(p.messages())
        if list(theirs) != ours:
            raise RuntimeError(
                f"the tokenizer's chat template gives {list(theirs)} for {p.question!r}, the renderer "
                f"{ours}: the two libraries would train on different prompts. Fix the template."
            )


def run_trl(config: GRPOConfig, sft_path: Path, test: list[llm.Problem], threads: int) -> dict:
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback

    tokenizer = AutoTokenizer.from_pretrained(sft_path)
    renderer = llm.ChatMLRenderer(tokenizer)
    im_end = renderer.get_stop_sequences()[0]
    problems = train_problems(config)
    check_chat_template(tokenizer, renderer, problems[0])
    dataset = Dataset.from_list([{"prompt": p.messages(), "answer": p.answer} for step in problems for p in step])

    text_mismatches = 0

    def edurl_reward(completions, completion_ids, answer, **kwargs):
        # completion_ids stop after the first <|im_end|>: without one the reply ran out of tokens (incomplete)
        nonlocal text_mismatches
        texts = [c[0]["content"] for c in completions]  # decoded by TRL with special tokens skipped
        text_mismatches += sum(t != renderer.parse_response(ids)[0]["content"] for t, ids in zip(texts, completion_ids))
        return [llm.grade(t, a, complete=im_end in ids).reward for t, ids, a in zip(texts, completion_ids, answer)]

    class StepClock(TrainerCallback):
        """Wall time of each optimizer step, and the mean reward TRL logs for it."""

        def __init__(self):
            self.step_times, self.rewards, self._t = [], [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if torch.get_num_threads() != threads:
                raise RuntimeError(f"TRL runs with {torch.get_num_threads()} torch threads, expected {threads}")
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_times.append(time.perf_counter() - self._t)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])

    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as output_dir:
        t0 = time.perf_counter()
        trainer = trl.GRPOTrainer(
            model=str(sft_path),
            reward_funcs=edurl_reward,
            args=trl_args(config, output_dir),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[clock],
        )
        trainer.remove_callback(PrinterCallback)  # it prints every step's logs; the clock keeps what we need
        setup = time.perf_counter() - t0
        if trainer.eos_token_ids != [im_end]:
            raise RuntimeError(f"TRL stops generation at {trainer.eos_token_ids}, expected [{im_end}] (<|im_end|>)")
        if trainer.accelerator.device.type != "cpu" or trainer.model.dtype != torch.float32:
            raise RuntimeError(
                f"TRL trains on {trainer.accelerator.device} in {trainer.model.dtype}; "
                "this benchmark compares float32 on the CPU"
            )
        before = llm.evaluate(trainer.model, renderer, test)
        t1 = time.perf_counter()
        trainer.train()
        total = setup + time.perf_counter() - t1
    if len(clock.step_times) != config.max_steps:
        raise RuntimeError(f"TRL ran {len(clock.step_times)} optimizer steps, expected {config.max_steps}")
    if text_mismatches:
        print(f"  note: {text_mismatches} TRL completion texts differ from edurl's parse_response (special tokens)")
    after = llm.evaluate(trainer.model, renderer, test)
    return summarize("TRL", config.seed, clock.step_times, total, before, after, clock.rewards)


# ---------------------------------------------------------------- main


def warm_up(config: GRPOConfig, sft_path: Path, test: list[llm.Problem], threads: int) -> None:
    """Two untimed steps of each library, so neither pays the process's one-time costs (lazy imports, kernel
    set-up, the allocator growing to a step's size) in its timed run. Without them, in 3- and 4-step runs, the
    library that ran first was 2-4x slower per step than in a second run, whichever library it was."""
    short = replace(config, max_steps=2)
    run_edurl(short, test[:8])
    run_trl(short, sft_path, test[:8], threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="GRPO steps per library")
    ap.add_argument("--seeds", type=seed_list, default="0", help="comma-separated seeds, e.g. 0,1,2")
    ap.add_argument("--lr", type=float, default=GRPOConfig.learning_rate, help="constant Adam learning rate")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads for both libraries")
    ap.add_argument("--smoke", action="store_true", help="3 steps each: a quick end-to-end check")
    args = ap.parse_args()
    steps = 3 if args.smoke else args.steps
    seeds = args.seeds
    torch.set_num_threads(args.threads)
    transformers.logging.disable_progress_bar()  # "Loading weights" bars
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)  # TRL's call

    rows, warmed_up = [], False
    for seed in seeds:
        _, _, _, sft_path = llm.load_or_train_sft(llm.SFTConfig(seed=seed), progress=False)
        test = llm.SFTConfig().task().sample(NUM_TEST, split="test", seed=0)
        with tempfile.TemporaryDirectory(prefix="edurl-grpo-") as log_dir:
            config = edurl_config(seed, steps, args.lr, args.threads, log_dir)
            if not warmed_up:
                warm_up(config, sft_path, test, args.threads)
                warmed_up = True
            rows.append(run_edurl(config, test))
            print_row(rows[-1])
            rows.append(run_trl(config, sft_path, test, args.threads))
            print_row(rows[-1])

    df = pd.DataFrame(rows).set_index(["seed", "library"])
    print(
        f"\nGRPO on 2-digit addition: {BATCH_SIZE} problems x {GROUP_SIZE} completions per step, {steps} steps, "
        f"lr={args.lr:g}, max_tokens={MAX_TOKENS}, threads={args.threads}, CPU; s/step: median after step 1; "
        f"pass@1: greedy on {NUM_TEST} test problems"
    )
    print(df.to_string(float_format=lambda x: f"{x:,.3f}"))
    edurl, trl_ = df.xs("edurl", level="library"), df.xs("TRL", level="library")
    ratios = pd.DataFrame(
        {
            "edurl speed-up (steps/s over TRL)": trl_["s/step"] / edurl["s/step"],
            "total s (TRL over edurl)": trl_["total s"] / edurl["total s"],
            "gain edurl": edurl["gain"],
            "gain TRL": trl_["gain"],
        }
    )
    if len(seeds) > 1:
        ratios.loc["median"] = ratios.median()
    print("\n" + ratios.to_string(float_format=lambda x: f"{x:,.3f}"))


if __name__ == "__main__":
    main()
