"""Reward model and DPO: edurl vs TRL's ``RewardTrainer`` and ``DPOTrainer`` on the same pairs, same run, CPU
(Chapter 8).

Both libraries start from the same SFT checkpoint of Chapter 6 (the reward model from the same seeded scalar head,
``load_reward_model``), train on the same labelled pairs, and are scored by the same edurl functions on the same
held-out pairs: ``pair_metrics`` for the reward models, ``dpo_metrics`` (the implicit reward) for DPO. The settings
are matched one by one:

=======================  =====================================================  ====================================
setting                  edurl                                                  TRL 1.16
=======================  =====================================================  ====================================
pairs per step           ``batch_size=64``                                      ``per_device_train_batch_size=64``
passes over the pairs    ``epochs``                                             ``num_train_epochs``
reward-model loss        ``bradley_terry_loss``: mean -log sigmoid(r_c - r_r)   ``RewardTrainer``'s (no margin, no
                                                                                ``center_rewards_coefficient``)
DPO loss                 ``dpo_loss``, ``beta``                                 ``loss_type=["sigmoid"]``, ``beta``,
                                                                                no label smoothing
DPO reference            a frozen copy of the SFT model, scored every step      ``ref_model`` (the same), scored
                                                                                every step (no precompute)
optimizer                AdamW (0.9, 0.999), eps 1e-8, wd 0, grad norm 1,       ``adamw_torch``, the same betas, eps,
                         constant lr                                            wd, ``max_grad_norm``, constant lr
precision, device        float32, CPU, dropout off                              ``use_cpu=True``, ``bf16=False``,
                                                                                no gradient checkpointing (checked)
tokens                   the pairs' token ids                                   reward model: the same ids
                                                                                (``chosen_ids``); DPO: their text,
                                                                                which TRL re-tokenises to the same
                                                                                ids (checked)
=======================  =====================================================  ====================================

The batch order differs (each library shuffles with its own generator), so the accuracies differ by that noise:
compare them over seeds. Timing: seconds per optimizer step is the mean over the run's steps (edurl:
``time/train`` of the history, evaluations excluded; TRL: from ``on_step_begin`` to ``on_step_end``). Both
libraries first run an untimed 2-step warm-up. The numbers mean something only on an otherwise idle CPU.

Pairs (``--pairs``):

* ``length`` (default): ``length_pairs``, replies that differ only in length, labelled by a length-liking rater:
  a preference both libraries can learn, so the accuracies are comparable;
* ``gold``: pairs sampled from the SFT policy and labelled by the gold rater (Chapter 8's data). On these the
  reward model learns little (``benchmarks/reward_model_learnability.py``), so only the seconds compare.

    python benchmarks/preference_vs_trl.py                       # length pairs, seed 0, 2 threads
    python benchmarks/preference_vs_trl.py --seeds 0,1,2
    python benchmarks/preference_vs_trl.py --smoke               # 2 steps each: does it run end to end?
"""

from __future__ import annotations

import os

# TRL and transformers must never reach the Hub: the model, tokenizer and data are all local.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ[_var] = "1"

import argparse
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, replace

import pandas as pd
import torch
import transformers
from _args import seed_list  # benchmarks/ is on sys.path when a script runs

from edurl.llm.clients import disable_dropout
from edurl.llm.preference import (
    DPOConfig,
    PreferenceData,
    RewardModelConfig,
    dpo_metrics,
    fit_reward_model,
    length_preference_data,
    load_reward_model,
    pair_metrics,
    preference_data,
    train_dpo,
)

BATCH_SIZE = 64


@dataclass
class Settings:
    epochs: int
    rm_lr: float
    dpo_lr: float
    beta: float
    seed: int
    threads: int
    max_steps: int | None = None
    """Cut each run to this many steps (the smoke test and the warm-up)."""


def make_pairs(kind: str, seed: int, num_train: int, num_test: int) -> PreferenceData:
    config = RewardModelConfig(seed=seed, num_train_problems=num_train, num_test_problems=num_test, progress=False)
    if kind == "gold":
        return preference_data(config)
    return length_preference_data(replace(config, length_bonus=0.5))


def cut(data: PreferenceData, s: Settings) -> list:
    return data.train_pairs if s.max_steps is None else data.train_pairs[: s.max_steps * BATCH_SIZE]


def trl_common(output_dir: str, s: Settings, lr: float) -> dict:
    """The TrainingArguments both TRL trainers share: the optimizer and the CPU/float32 setting of the table."""
    return dict(
        output_dir=output_dir,
        seed=s.seed,
        num_train_epochs=s.epochs,
        per_device_train_batch_size=BATCH_SIZE,
        gradient_accumulation_steps=1,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        dataloader_pin_memory=False,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        disable_dropout=True,
    )


def step_clock():
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Wall time of each optimizer step."""

        def __init__(self):
            self.step_times, self._t = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_times.append(time.perf_counter() - self._t)

    return StepClock()


def check_cpu_float32(trainer) -> None:
    if trainer.accelerator.device.type != "cpu" or trainer.model.dtype != torch.float32:
        raise RuntimeError(f"TRL trains on {trainer.accelerator.device} in {trainer.model.dtype}; expected CPU float32")
    if getattr(trainer.model, "is_gradient_checkpointing", False):
        raise RuntimeError("TRL turned gradient checkpointing on; this benchmark compares plain float32 steps")


# ---------------------------------------------------------------- reward model


def edurl_reward_model(data: PreferenceData, s: Settings) -> dict:
    model = load_reward_model(data.path, seed=s.seed)
    pairs = cut(data, s)
    history = fit_reward_model(
        model,
        pairs,
        data.test_pairs,
        batch_size=BATCH_SIZE,
        epochs=s.epochs,
        learning_rate=s.rm_lr,
        eval_every=10**9,
        seed=s.seed,
        progress=False,
    )
    end = history[-1]
    return {"steps": end["step"], "s/step": end["time/train"] / end["step"], **pair_metrics(model, data.test_pairs)}


def trl_reward_model(data: PreferenceData, s: Settings) -> dict:
    import trl
    from datasets import Dataset
    from transformers import PrinterCallback

    model = load_reward_model(data.path, seed=s.seed)
    pairs = cut(data, s)
    dataset = Dataset.from_dict(
        {
            "chosen_ids": [list(p.prompt) + list(p.chosen) for p in pairs],
            "rejected_ids": [list(p.prompt) + list(p.rejected) for p in pairs],
        }
    )
    clock = step_clock()
    with tempfile.TemporaryDirectory(prefix="trl-rm-") as output_dir:
        args = trl.RewardConfig(**trl_common(output_dir, s, s.rm_lr), center_rewards_coefficient=None, max_length=None)
        trainer = trl.RewardTrainer(
            model=model, args=args, train_dataset=dataset, processing_class=data.tokenizer, callbacks=[clock]
        )
        trainer.remove_callback(PrinterCallback)
        check_cpu_float32(trainer)
        trainer.train()
    steps = len(clock.step_times)
    return {"steps": steps, "s/step": statistics.fmean(clock.step_times), **pair_metrics(model, data.test_pairs)}


# ---------------------------------------------------------------- DPO


def edurl_dpo(data: PreferenceData, s: Settings) -> dict:
    subset = PreferenceData(data.policy, data.tokenizer, data.path, data.rater, cut(data, s), data.test_pairs)
    config = DPOConfig(
        beta=s.beta,
        batch_size=BATCH_SIZE,
        epochs=s.epochs,
        learning_rate=s.dpo_lr,
        eval_every=10**9,
        seed=s.seed,
        num_threads=s.threads,
        progress=False,
    )
    result = train_dpo(subset, config)
    end = result.final
    metrics = dpo_metrics(result.policy, result.reference, data.test_pairs, s.beta, data.tokenizer.pad_token_id)
    return {"steps": end["step"], "s/step": end["time/train"] / end["step"], **metrics}


def trl_dpo(data: PreferenceData, s: Settings) -> dict:
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback

    tok = data.tokenizer
    pairs = cut(data, s)
    text = lambda ids: tok.decode(list(ids), skip_special_tokens=False)  # noqa: E731
    rows = [{"prompt": text(p.prompt), "chosen": text(p.chosen), "rejected": text(p.rejected)} for p in pairs]
    for row, p in zip(rows[:64], pairs):  # TRL re-tokenises the text: it must give back the same ids
        if tok(row["prompt"] + row["chosen"], add_special_tokens=False)["input_ids"] != list(p.prompt) + list(p.chosen):
            raise RuntimeError("the tokenizer does not round-trip a pair's text; TRL would train on other tokens")
    policy = disable_dropout(AutoModelForCausalLM.from_pretrained(data.path))
    reference = disable_dropout(AutoModelForCausalLM.from_pretrained(data.path)).eval()
    clock = step_clock()
    with tempfile.TemporaryDirectory(prefix="trl-dpo-") as output_dir:
        args = trl.DPOConfig(
            **trl_common(output_dir, s, s.dpo_lr),
            beta=s.beta,
            loss_type=["sigmoid"],
            label_smoothing=0.0,
            precompute_ref_log_probs=False,
            max_length=None,
        )
        trainer = trl.DPOTrainer(
            model=policy,
            ref_model=reference,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[clock],
        )
        trainer.remove_callback(PrinterCallback)
        check_cpu_float32(trainer)
        trainer.train()
    steps = len(clock.step_times)
    metrics = dpo_metrics(policy, reference, data.test_pairs, s.beta, tok.pad_token_id)
    return {"steps": steps, "s/step": statistics.fmean(clock.step_times), **metrics}


RUNS = {
    ("reward model", "edurl"): edurl_reward_model,
    ("reward model", "TRL"): trl_reward_model,
    ("DPO", "edurl"): edurl_dpo,
    ("DPO", "TRL"): trl_dpo,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", choices=("length", "gold"), default="length")
    parser.add_argument("--seeds", type=seed_list, default="0", help="comma-separated seeds")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rm-lr", type=float, default=1e-3)
    parser.add_argument("--dpo-lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--train-pairs", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="2 steps of each run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    import datasets  # here, not at the top: --help works without the bench extra (TRL's datasets)

    datasets.disable_progress_bars()  # TRL's dataset preparation bars
    rows = []
    for seed in args.seeds:
        s = Settings(args.epochs, args.rm_lr, args.dpo_lr, args.beta, seed, args.threads)
        data = make_pairs(args.pairs, seed, args.train_pairs, 256)
        warm = Settings(1, args.rm_lr, args.dpo_lr, args.beta, seed, args.threads, max_steps=2)
        for run in RUNS.values():
            run(data, warm)  # untimed: lazy imports, allocator and thread-pool start-up
        if args.smoke:
            s = warm
        for (what, library), run in RUNS.items():
            t0 = time.perf_counter()
            out = run(data, s)
            rows.append(
                {
                    "what": what,
                    "library": library,
                    "seed": seed,
                    "steps": out["steps"],
                    "s/step": out["s/step"],
                    "held-out acc": out["expected_accuracy"],
                    "ceiling": out["ceiling"],
                    "acc / ceiling": out["expected_accuracy"] / out["ceiling"],
                    "chosen logp change": out.get("chosen_logp_change", math.nan),
                    "wall s": time.perf_counter() - t0,
                }
            )
            print(f"{what}, {library}, seed {seed}: {rows[-1]['s/step']:.3f} s/step", flush=True)
    table = pd.DataFrame(rows)
    print(f"\npairs: {args.pairs}; {args.epochs} epochs of {args.train_pairs} pairs, batch {BATCH_SIZE}")
    print(table.to_string(index=False, float_format="%.3f"))
    print("\nmedians over seeds of TRL's seconds per step / edurl's, and of edurl's acc / ceiling - TRL's")
    for what, frame in table.groupby("what", sort=False):
        e, t = (frame[frame.library == lib].set_index("seed") for lib in ("edurl", "TRL"))
        speed = (t["s/step"] / e["s/step"]).median()
        acc = (e["acc / ceiling"] - t["acc / ceiling"]).median()
        print(f"  {what:13s} TRL / edurl s/step: {speed:.2f}x; accuracy difference: {acc:+.3f} of the ceiling")


if __name__ == "__main__":
    main()
