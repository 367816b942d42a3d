"""The loop that GRPO (:func:`edurl.llm.grpo.train_grpo`) and its step-matched SFT baseline
(:func:`edurl.llm.sft.continued_sft`) share: build the trainer, resume, evaluate on held-out problems,
write ``metrics.jsonl`` and checkpoints, show a progress bar, and call a step function once per step.

``run_training_loop(config, step_fn, ...)`` reads these fields of ``config`` (a :class:`edurl.llm.GRPOConfig`):
``sft``, ``base_model``, ``lora_rank``, ``kl_coef``, ``log_kl_ref``, ``seed``, ``device``, ``num_threads``,
``num_eval``, ``max_tokens``, ``max_steps``, ``eval_every``, ``save_every``, ``resume``, ``log_dir`` and
``progress``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from edurl.llm.clients import ServiceClient, TrainingClient
from edurl.llm.distributed import SINGLE, World, refuse_under_torchrun
from edurl.llm.evaluation import EvalResult, evaluate, warn_if_cut
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.sft import load_or_train_sft
from edurl.metrics import MetricsLogger, load_metrics, truncate_metrics
from edurl.utils import device as pick_device
from edurl.utils import file_in_the_way, progress, torch_threads, usable_cpus, warn_at_caller

if TYPE_CHECKING:
    from edurl.llm.grpo import GRPOConfig

__all__ = [
    "GRPOResult",
    "check_lora_rank",
    "make_training_client",
    "new_training_client",
    "problem_seed",
    "run_training_loop",
    "substeps",
]


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


def check_lora_rank(lora_rank) -> None:
    """Refuse a ``lora_rank`` that is neither None (train every weight) nor a positive int."""
    if lora_rank is not None and (not isinstance(lora_rank, int) or isinstance(lora_rank, bool) or lora_rank < 1):
        raise ValueError(f"lora_rank must be None (train every weight) or a positive int, got {lora_rank!r}")


def new_training_client(
    base, *, lora_rank: int | None, seed: int, keep_reference: bool, device: torch.device, log_dir=None
) -> TrainingClient:
    """A trainer on ``device`` (as :func:`edurl.utils.device` picked it) on ``base`` (a warm start's ``(model,
    tokenizer)``, a model folder or a hub id): a LoRA adapter of ``lora_rank`` (its switched-off adapter is the KL
    reference), or every weight, with a frozen copy as the reference when ``keep_reference``. The caller's model is
    copied, never trained in place."""
    service = ServiceClient(device=device, log_dir=log_dir)
    if lora_rank is not None:
        # the adapter's random initialisation comes from the run's seed (as edurl.serve seeds it from lora_config's),
        # not from whatever the global generator holds by now
        torch.manual_seed(seed)
        return service.create_lora_training_client(base, rank=lora_rank)
    return service.create_training_client(base, keep_reference=keep_reference)


def make_training_client(config: GRPOConfig) -> tuple[TrainingClient, ChatMLRenderer, object]:
    """The trainer (from the SFT checkpoint or ``base_model``), the renderer and the task."""
    device = pick_device(config.device)  # a misspelt device is named before the warm start trains
    if config.base_model is None:
        # the warm start is trained with GRPO's seed (GRPOConfig refuses an sft.seed that differs)
        model, tokenizer, _, _ = load_or_train_sft(replace(config.sft, seed=config.seed), progress=config.progress)
        base = (model, tokenizer)
    else:
        base = config.base_model
    trainer = new_training_client(
        base,
        lora_rank=config.lora_rank,
        seed=config.seed,
        keep_reference=config.kl_coef > 0 or config.log_kl_ref,
        device=device,
        log_dir=config.log_dir,
    )
    trainer.score_zero_advantage = config.score_zero_advantage
    return trainer, ChatMLRenderer(trainer.tokenizer), config.sft.task()


def warn_if_replies_do_not_fit(max_tokens: int, renderer: ChatMLRenderer, task, seed: int = 0) -> None:
    """Warn when ``max_tokens`` cuts off some of 256 of ``task``'s reference replies (see
    :func:`edurl.llm.evaluation.warn_if_cut`): the run would grade replies like them as wrong, and nothing else says
    so."""
    warn_if_cut(renderer, task.sample(256, split="train", seed=seed), max_tokens, "this task's")


def _checkpoints(log_dir: Path) -> list[Path]:
    return sorted(p for p in (log_dir / "checkpoints").glob("step_*") if (p / "state.pt").exists())


RESUME_MAY_CHANGE = frozenset(
    {"max_steps", "resume", "overwrite", "progress", "eval_every", "save_every", "log_dir", "num_threads", "device"}
    | {"concurrent_sampler", "sampler_process"}  # the same batches either way (Chapter 10)
    | {"max_steps_off_policy"}  # the lag from here on; the resume checks that the checkpoint kept the weights it needs
)
"""The config fields a resumed run may set differently from the run it continues: where and how long it runs, and
what it shows; every other field changes what the run computes."""


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _config_json(config, desc: str, folder: bool = False) -> str:
    """The config as the run's ``config.json`` holds it. ``folder=True`` adds ``base_model_folder``: the real path
    of a ``base_model`` that is a local folder (None for a hub id or the course's warm start), so that a resume
    can tell the same folder spelt another way from another folder behind the same spelling."""
    fields = {"run": desc, **asdict(config)}
    if folder:
        base = fields.get("base_model")
        fields["base_model_folder"] = os.path.realpath(base) if base and os.path.isdir(base) else None
    return json.dumps(fields, indent=1, default=str)


def _check_same_config(config: GRPOConfig, desc: str, world: World) -> None:
    """Under torchrun: every rank must run the same config (a rank with its own log_dir, seed or learning rate
    would fail at the end or train a copy that silently drifts from the one rank 0 saves); and warn when the
    ranks' threads outnumber the cores they may run on. One all_gather."""
    if world.size == 1:
        return
    gathered = world.all_gather_object((_config_json(config, desc), socket.gethostname(), sorted(usable_cpus())))
    every = [json.loads(c) for c, _, _ in gathered]
    first = every[0]
    differ = sorted({k for c in every for k in {*c, *first} if c.get(k) != first.get(k)})
    if differ:  # every rank sees it, so every rank refuses
        shown = "; ".join(
            f"{k}: " + ", ".join(f"{c.get(k)!r} on rank {r}" for r, c in enumerate(every)) for k in differ
        )
        raise ValueError(
            f"the ranks were given different configs ({shown}): every rank must run the same one, with the same "
            "log_dir (rank 0 alone writes there). Pass the same arguments to every rank."
        )
    # the ranks on rank 0's machine, and the cores any of them may use (each rank may be bound to cores of its own)
    local = [set(cpus) for _, host, cpus in gathered if host == gathered[0][1]]
    ranks_here, cores = len(local), len(set().union(*local))
    if world.is_main and world.device == "cpu" and config.num_threads * ranks_here > cores:
        cores_text = f"{cores} core{'s' if cores != 1 else ''}"
        fix = (
            f"Pass num_threads={cores // ranks_here} (--num-threads {cores // ranks_here})."
            if ranks_here <= cores
            else f"Run at most {cores} rank{'s' if cores != 1 else ''} here (torchrun --nproc_per_node {cores}), "
            "each with num_threads=1."
        )
        warn_at_caller(
            f"num_threads={config.num_threads} in each of {ranks_here} ranks on this machine is "
            f"{config.num_threads * ranks_here} threads for the {cores_text} they may run on: threads that outnumber "
            f"the cores wait on each other, and a step can take several times as long. {fix}",
        )


def _earlier_run(log_dir: Path) -> tuple[list[Path], int]:
    """An earlier run in ``log_dir``: its checkpoints, oldest first, and how many steps its metrics.jsonl logged."""
    metrics = log_dir / "metrics.jsonl"
    logged = sum(1 for line in metrics.open(encoding="utf-8") if line.strip()) if metrics.is_file() else 0
    return _checkpoints(log_dir), logged


def _delete_earlier_run(log_dir: Path) -> None:
    """``overwrite=True``: delete the earlier run's checkpoints and metrics in ``log_dir``. Called after the run's
    setup has succeeded (the warm start, the first evaluation and ``on_start``, which starts an off-policy run's
    sampler), so that a bad flag beside ``--overwrite`` fails with the earlier run still there."""
    checkpoints, logged = _earlier_run(log_dir)
    if checkpoints or logged:
        shutil.rmtree(log_dir / "checkpoints", ignore_errors=True)
        (log_dir / "metrics.jsonl").unlink(missing_ok=True)
        print(f"overwrite=True: deleted the earlier run in {log_dir} ({logged} logged steps, "
              f"{len(checkpoints)} checkpoints)")  # fmt: skip


def _check_log_dir(config: GRPOConfig, log_dir: Path, desc: str, main: bool = True) -> list[Path]:
    """The checkpoints to resume from, after refusing what would mix two runs or lose one: a fresh run into a
    folder with an earlier run's checkpoints (a later resume would load them), a resume with nothing to resume
    from but an earlier run's metrics (they would be overwritten), and a resume whose config computes something
    else than the run it continues."""
    clash = file_in_the_way(log_dir)
    if clash is not None:
        raise ValueError(f"log_dir {clash}; pass a folder (it is made if missing)")
    checkpoints, logged = _earlier_run(log_dir)
    if not config.resume:
        if config.overwrite:
            return []  # deleted by _delete_earlier_run once the model, threads and device are known to work
        if checkpoints:
            raise ValueError(
                f"log_dir {str(log_dir)!r} holds an earlier run's checkpoints (newest: {checkpoints[-1].name}), "
                "which a later resume=True would load into this run. Continue that run with resume=True (--resume), "
                "replace it with overwrite=True (--overwrite), or start this one in another log_dir (--log-dir)."
            )
        if logged:
            warn_at_caller(
                f"log_dir {str(log_dir)!r} holds an earlier run's metrics.jsonl ({logged} steps, no checkpoints); "
                "this run replaces it. Pass another log_dir to keep both.",
            )
        return []
    if not checkpoints:
        if logged:
            partial = sorted(p.parent.name for p in (log_dir / "checkpoints").glob("*/*.tmp"))
            why = (
                f"its only checkpoint was cut off while being written ({partial[-1]}: a .tmp file, no state.pt)"
                if partial
                else "that run saved none (save_every=0, or it stopped before its first save)"
            )
            raise ValueError(
                f"resume=True, but log_dir {str(log_dir)!r} holds no checkpoint to resume from, only an earlier "
                f"run's metrics.jsonl ({logged} steps), which a fresh start would overwrite: {why}. Start again "
                "without resume in another log_dir, or delete the folder first."
            )
        return []  # nothing there yet: resume=True starts the run (a job that may be restarted can always pass it)
    saved_file = log_dir / "config.json"
    if saved_file.is_file():
        saved = _flat(json.loads(saved_file.read_text(encoding="utf-8")))
        now = _flat(json.loads(_config_json(config, desc, folder=True)))
        if "base_model_folder" not in saved:  # saved before the field existed: the spelling alone decides
            now.pop("base_model_folder")
        elif saved["base_model_folder"] and now["base_model_folder"]:  # two local folders: their real paths
            saved["base_model"] = now["base_model"] = None  # decide, not how each run spelt them
        differ = [
            k
            for k in sorted(saved.keys() | now.keys())
            if k.split(".")[0] not in RESUME_MAY_CHANGE and saved.get(k) != now.get(k)
        ]
        if differ:
            shown = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in differ[:6])
            raise ValueError(
                f"resume=True, but this config differs from the run in {str(log_dir)!r} ({saved_file.name}) in "
                f"{len(differ)} field(s) that change what it computes: {shown}. Resume with that run's settings "
                f"(only {', '.join(sorted(RESUME_MAY_CHANGE - {'resume'}))} may change), or start a new run in "
                "another log_dir."
                + (
                    " Under torchrun every rank samples per problem (sample_per_problem=True), so a run made without "
                    "it resumes only in one process (python -m, not torchrun)."
                    if differ == ["sample_per_problem"] and saved.get("sample_per_problem") is False
                    else ""
                )
            )
    step = int(checkpoints[-1].name.removeprefix("step_"))
    if step > config.max_steps:
        raise ValueError(
            f"resume=True, but the newest checkpoint in {str(log_dir)!r} is at step {step}, past "
            f"max_steps={config.max_steps}: the result would be step {step}'s model. Pass max_steps >= {step}."
        )
    return checkpoints


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
    if world.size == 1:  # handed one process: under torchrun, every rank would train the whole run
        refuse_under_torchrun(desc)
    log_dir = Path(config.log_dir)
    main = world.is_main
    _check_same_config(config, desc, world)
    found = _check_log_dir(config, log_dir, desc, main)  # on every rank, before any work: all refuse alike
    with torch_threads(config.num_threads):
        if not main:
            world.barrier()  # rank 0 trains (or loads) the cached warm start first, so no two ranks write it
        trainer, renderer, task = make_training_client(config)
        if main:
            world.barrier()
            warn_if_replies_do_not_fit(config.max_tokens, renderer, task, config.seed)
        world.broadcast_parameters(trainer.model)  # every copy starts from rank 0's weights
        test = task.sample(config.num_eval, split="test", seed=config.seed)
        start_step, start_eval, logger, bar = 0, None, None, None
        try:
            checkpoints = world.broadcast_object(found)
            if checkpoints:
                checkpoint = checkpoints[-1]
                extra = trainer.load_state(checkpoint)
                if on_resume is not None:
                    on_resume(trainer, checkpoint, extra)
                start_step = extra["step"]
            else:
                if main:
                    start_eval = evaluate(
                        trainer.model, renderer, test, max_tokens=config.max_tokens, check_max_tokens=False
                    )
                start_eval = world.broadcast_object(start_eval)
            if on_start is not None:  # after the first evaluation, so that no step's work overlaps it
                on_start(trainer, renderer, task, start_step)
            # only now, with everything set up: a refusal until here leaves the earlier run's files as they were
            if main and checkpoints:
                truncate_metrics(log_dir, start_step)  # drop steps logged after the checkpoint
                logger = MetricsLogger(log_dir, if_exists="append")
            elif main:
                if config.overwrite and not config.resume:  # rank 0 alone deletes; the others find nothing to resume
                    _delete_earlier_run(log_dir)
                logger = MetricsLogger(log_dir, if_exists="overwrite")
                (log_dir / "config.json").write_text(_config_json(config, desc, folder=True), encoding="utf-8")
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
                    ev = evaluate(trainer.model, renderer, test, max_tokens=config.max_tokens, check_max_tokens=False)
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
        finally:  # also when a step raises or the learner stops the cell: an open metrics.jsonl cannot be
            # replaced or deleted on Windows, so the next resume or overwrite in the same kernel would fail
            if bar is not None:
                bar.close()
            if logger is not None:
                logger.close()
        final = None
        if main:
            final = evaluate(trainer.model, renderer, test, max_tokens=config.max_tokens, check_max_tokens=False)
        final = world.broadcast_object(final)  # also waits for rank 0's metrics.jsonl to be complete
    return GRPOResult(config, load_metrics(log_dir), trainer, start_eval, final)
