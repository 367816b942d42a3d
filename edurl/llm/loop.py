"""The loop that GRPO (:func:`edurl.llm.grpo.train_grpo`) and its compute-matched SFT baseline
(:func:`edurl.llm.sft.continued_sft`) share: build the trainer, resume, evaluate on held-out problems,
write ``metrics.jsonl`` and checkpoints, show a progress bar, and call a step function once per step.

``run_training_loop(config, step_fn, ...)`` reads these fields of ``config`` (a :class:`edurl.llm.GRPOConfig`):
``sft``, ``base_model``, ``lora_rank``, ``kl_coef``, ``log_kl_ref``, ``seed``, ``device``, ``num_threads``,
``num_eval``, ``max_tokens``, ``max_steps``, ``eval_every``, ``save_every``, ``resume``, ``log_dir`` and
``progress``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from edurl.llm.clients import ServiceClient, TrainingClient
from edurl.llm.distributed import SINGLE, World
from edurl.llm.evaluation import EvalResult, evaluate
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.sft import load_or_train_sft
from edurl.metrics import MetricsLogger, load_metrics, truncate_metrics
from edurl.utils import device as pick_device
from edurl.utils import progress, torch_threads

if TYPE_CHECKING:
    from edurl.llm.grpo import GRPOConfig

__all__ = ["GRPOResult", "make_training_client", "problem_seed", "run_training_loop", "substeps"]


@dataclass
class GRPOResult:
    """What :func:`train_grpo` (and its baseline :func:`edurl.llm.sft.continued_sft`) returns."""

    config: Any
    """The run's :class:`edurl.llm.GRPOConfig`."""
    metrics: pd.DataFrame
    """One row per step (metrics.jsonl)."""
    trainer: TrainingClient
    start: EvalResult | None
    """Held-out evaluation before the first step (None when resumed)."""
    final: EvalResult
    """Held-out evaluation after the last step."""


def problem_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s problems and samples: a function of (seed, step), so resumed runs repeat."""
    return (1_000_003 * (seed + 1) + step) % 2**63  # a seed torch's generators take, for any seed


def group_seed(step_seed: int, i: int) -> int:
    """The sampling seed of problem ``i``'s group in a step seeded ``step_seed`` (``sample_per_problem``)."""
    return (step_seed * 100_003 + i) % 2**63


def substeps(datums: list, num_substeps: int) -> list[list]:
    """``datums`` cut into ``num_substeps`` consecutive slices, one optimizer step each: sizes that differ by at most
    1, the longer first (as many slices as datums when there are fewer)."""
    if not isinstance(num_substeps, int) or num_substeps < 1:
        raise ValueError(f"num_substeps must be a positive int, got {num_substeps!r}")
    size, extra = divmod(len(datums), num_substeps)
    bounds = [k * size + min(k, extra) for k in range(num_substeps + 1)]
    return [datums[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def make_training_client(config: GRPOConfig) -> tuple[TrainingClient, ChatMLRenderer, object]:
    """The trainer (from the SFT checkpoint or ``base_model``), the renderer and the task."""
    service = ServiceClient(device=pick_device(config.device), log_dir=config.log_dir)
    if config.base_model is None:
        # the warm start is trained with GRPO's seed (GRPOConfig refuses an sft.seed that differs)
        model, tokenizer, _, _ = load_or_train_sft(replace(config.sft, seed=config.seed), progress=config.progress)
        base = (model, tokenizer)
    else:
        base = config.base_model
    if config.lora_rank is not None:
        # the adapter's random initialisation comes from the run's seed (as edurl.serve seeds it from lora_config's),
        # not from whatever the global generator holds by now
        torch.manual_seed(config.seed)
        trainer = service.create_lora_training_client(base, rank=config.lora_rank)
    else:
        trainer = service.create_training_client(base, keep_reference=config.kl_coef > 0 or config.log_kl_ref)
    trainer.score_zero_advantage = config.score_zero_advantage
    return trainer, ChatMLRenderer(trainer.tokenizer), config.sft.task()


def _checkpoints(log_dir: Path) -> list[Path]:
    return sorted(p for p in (log_dir / "checkpoints").glob("step_*") if (p / "state.pt").exists())


def run_training_loop(
    config: GRPOConfig,
    step_fn,
    desc: str,
    postfix: str,
    on_resume=None,
    sampler_to_save=None,
    extra_to_save=None,
    world: World = SINGLE,
    on_start=None,
) -> GRPOResult:
    """The loop around ``step_fn(trainer, renderer, task, step) -> metrics row``: resume, held-out
    evaluation every ``eval_every`` steps, ``metrics.jsonl``, checkpoints and a progress bar.
    ``on_resume(trainer, checkpoint, extra)`` restores what the step function carries between steps,
    ``sampler_to_save()`` names a sampler that every checkpoint must keep, and ``extra_to_save(next_step)`` returns
    a dict that the checkpoint keeps in its ``extra`` (handed back to ``on_resume``). ``on_start(trainer, renderer,
    task, start_step)`` runs once, after any resume and the first held-out evaluation, before the first step.

    Under data parallelism (``world``, see :mod:`edurl.llm.distributed`) every rank runs this loop; only rank 0
    evaluates, logs and checkpoints, every rank resumes from rank 0's checkpoint, and the evaluations that the
    result carries are rank 0's on every rank."""
    log_dir = Path(config.log_dir)
    main = world.is_main
    with torch_threads(config.num_threads):
        if not main:
            world.barrier()  # rank 0 trains (or loads) the cached warm start first, so no two ranks write it
        trainer, renderer, task = make_training_client(config)
        if main:
            world.barrier()
        world.broadcast_parameters(trainer.model)  # every copy starts from rank 0's weights
        test = task.sample(config.num_eval, split="test", seed=config.seed)
        start_step, start_eval, logger = 0, None, None
        checkpoints = world.broadcast_object(_checkpoints(log_dir) if config.resume else [])
        if checkpoints:
            checkpoint = checkpoints[-1]
            extra = trainer.load_state(checkpoint)
            if on_resume is not None:
                on_resume(trainer, checkpoint, extra)
            start_step = extra["step"]
            if main:
                truncate_metrics(log_dir, start_step)  # drop steps logged after the checkpoint
                logger = MetricsLogger(log_dir, if_exists="append")
        else:
            if main:
                logger = MetricsLogger(log_dir, if_exists="overwrite")
                config_json = json.dumps({"run": desc, **asdict(config)}, indent=1, default=str)
                (log_dir / "config.json").write_text(config_json)
                start_eval = evaluate(trainer.model, renderer, test, max_tokens=config.max_tokens)
            start_eval = world.broadcast_object(start_eval)
        if on_start is not None:  # after the first evaluation, so that no step's work overlaps it
            on_start(trainer, renderer, task, start_step)
        bar = progress(
            range(start_step, config.max_steps),
            desc=desc,
            disable=not (config.progress and main),
            initial=start_step,
            total=config.max_steps,
        )
        for step in bar:
            t0 = time.perf_counter()
            row = step_fn(trainer, renderer, task, step)
            row["time/step"] = time.perf_counter() - t0  # the step's wall time, evaluation excluded
            if not main:  # the other ranks wait for rank 0's evaluation at the next step's first exchange
                continue
            if (step + 1) % config.eval_every == 0 or step + 1 == config.max_steps:
                ev = evaluate(trainer.model, renderer, test, max_tokens=config.max_tokens)
                row.update({"test/pass_at_1": ev.pass_at_1, "test/format": ev.format})
                shown = {postfix.rsplit("/", 1)[-1]: f"{row[postfix]:.2f}"} if postfix in row else {}
                bar.set_postfix({**shown, "test": f"{ev.pass_at_1:.2f}"}, refresh=False)
            if step == 0 and start_eval is not None:
                row.update({"test/start_pass_at_1": start_eval.pass_at_1})
            logger.log(step, **row)
            if config.save_every and (step + 1) % config.save_every == 0:
                trainer.save_state(
                    f"step_{step + 1:06d}",
                    extra={"step": step + 1, **(extra_to_save(step + 1) if extra_to_save is not None else {})},
                    sampler=sampler_to_save() if sampler_to_save is not None else None,
                )
        bar.close()
        final = None
        if main:
            logger.close()
            final = evaluate(trainer.model, renderer, test, max_tokens=config.max_tokens)
        final = world.broadcast_object(final)  # also waits for rank 0's metrics.jsonl to be complete
    return GRPOResult(config, load_metrics(log_dir), trainer, start_eval, final)
