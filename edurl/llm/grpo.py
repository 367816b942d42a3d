"""GRPO on verifiable tasks, written with the local Tinker-style clients (Chapter 7).

One iteration is the seven steps of the reference loop::

    1. sampler = trainer.save_weights_and_get_sampling_client(...)   fresh weights every step
    2. sample G completions for each of P problems                   (P*G sequences, with log-probs)
    3. grade them: reward = correct + 0.1 * (format - 1)             rewards (P, G)
    4. advantages = rewards - group mean                             (P, G); 0 for a uniform group
    5. one Datum per completion (prompt masked, advantage on every action token)
    6. forward_backward(datums, loss_fn) then optim_step, num_substeps times over slices of the batch
    7. log the metrics; every eval_every steps, greedy pass@1 on held-out problems

``train_grpo`` resumes from the newest checkpoint in ``log_dir`` when ``resume=True``; problems and
sampling seeds are functions of (seed, step), and a checkpoint holds everything else the loop carries
(weights, Adam's moments, and the stale sampler when ``refresh_sampler=False``), so on a CPU a resumed
run repeats an uninterrupted one exactly, even after a kill at any moment.

A KL penalty to the starting policy (``kl_coef > 0``) goes into the reward by default, as in Tinker
(``kl_penalty="reward"``, see :func:`edurl.llm.losses.kl_penalty_advantages`); ``kl_penalty="loss"``
adds it to the loss instead, as TRL does.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch

from ..metrics import MetricsLogger, load_metrics, truncate_metrics
from ..utils import device as pick_device
from ..utils import progress, torch_threads
from . import losses as L
from .clients import AdamParams, ServiceClient, TrainingClient
from .datum import Datum, build_datum, build_supervised_datum
from .evaluation import EvalResult, evaluate
from .renderer import ChatMLRenderer
from .rewards import grade
from .sampling import SamplingParams
from .sft import SFTConfig, demonstration_example, load_or_train_sft


@dataclass
class GRPOConfig:
    """Settings of a GRPO run on the course's arithmetic task (every field is a recipe flag)."""

    sft: SFTConfig = field(default_factory=SFTConfig)
    """The warm start (Chapter 6), loaded from the SFT cache or trained once. Its task is the RL task."""
    base_model: str | None = None
    """A model folder or hub id to start from instead of the SFT checkpoint (e.g. a real chat model)."""
    lora_rank: int | None = None
    """None trains every weight; an int trains a peft LoRA adapter of that rank."""
    group_size: int = 8
    """G: completions per problem."""
    batch_size: int = 32
    """P: problems per step."""
    max_steps: int = 300
    """GRPO iterations."""
    learning_rate: float = 3e-4
    """Adam learning rate (constant)."""
    loss_fn: str = "importance_sampling"
    """importance_sampling, ppo, cispo or dro (see edurl.llm.losses)."""
    clip_low: float | None = None
    """Lower ratio bound for ppo and cispo's clip; None: the loss's own default (ppo 0.8, cispo 0.0)."""
    clip_high: float | None = None
    """Upper ratio bound for ppo and cispo's clip; None: the loss's own default (ppo 1.2, cispo 4.0)."""
    dro_beta: float = 0.05
    """beta of the dro loss."""
    aggregation: str = "token_mean"
    """sum, seq_mean_token_mean (GRPO), token_mean (DAPO) or seq_mean_token_sum_norm (Dr. GRPO)."""
    num_substeps: int = 1
    """Optimizer steps per batch, each on 1/num_substeps of it; > 1 moves the ratio away from 1."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to the starting policy (0: none)."""
    kl_penalty: str = "reward"
    """Where that penalty goes: "reward" (Tinker: kl_coef * (mean k1 - k1) added to each action token's
    advantage; its expected gradient is the reverse KL's) or "loss" (TRL: kl_coef * kl_estimator in the loss)."""
    kl_estimator: str = "k3"
    """k1, k2 or k3 for the "loss" penalty (k3's gradient is the forward KL's, k2's the reverse KL's)."""
    log_kl_ref: bool = False
    """Log optim/kl_ref (k3 to the starting policy) even without a penalty; costs one more forward pass."""
    advantage_scale: str = "none"
    """none (Dr. GRPO), group (GRPO's std division) or batch."""
    center_advantages: bool = True
    """False uses raw rewards as advantages: one of Chapter 7's common mistakes."""
    drop_uniform_groups: bool = False
    """Skip groups whose rewards are all equal (DAPO's dynamic sampling, without refilling)."""
    refresh_sampler: bool = True
    """False keeps the first step's sampler for the whole run: the stale-sampler mistake."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scores at the same one, so the ratio is exactly 1 on-policy."""
    max_tokens: int = 16
    """Most tokens per completion; also the fixed budget that Dr. GRPO's aggregation divides by."""
    eval_every: int = 25
    """Steps between held-out evaluations (greedy pass@1); also at the start and the end."""
    num_eval: int = 200
    """Held-out test problems per evaluation."""
    save_every: int = 0
    """Steps between checkpoints (0: none)."""
    resume: bool = False
    """Continue from the newest checkpoint in log_dir."""
    log_dir: str = "runs/grpo_arithmetic"
    """Where metrics.jsonl and checkpoints go."""
    seed: int = 0
    """Seeds everything: the SFT warm start (it replaces sft.seed), the problems and the sampling."""
    num_threads: int = 2
    """torch CPU threads."""
    device: str | None = None
    """Where the policy trains and samples: "cpu", "cuda", ...; None picks with edurl.device()."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        for name in ("group_size", "batch_size", "max_steps", "num_substeps", "max_tokens", "num_eval"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2: a group of one has advantage 0 after centring")
        if self.batch_size * self.group_size % self.num_substeps:
            raise ValueError(f"num_substeps ({self.num_substeps}) must divide batch_size * group_size "
                             f"({self.batch_size * self.group_size})")
        L.get_loss_fn(self.loss_fn)
        if self.aggregation not in L.AGGREGATION_MODES:
            raise ValueError(f"aggregation must be one of {L.AGGREGATION_MODES}, got {self.aggregation!r}")
        if self.advantage_scale not in L.ADVANTAGE_SCALES:
            raise ValueError(f"advantage_scale must be one of {L.ADVANTAGE_SCALES}, got {self.advantage_scale!r}")
        if self.kl_estimator not in L.KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {L.KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.kl_penalty not in L.KL_PENALTIES:
            raise ValueError(f"kl_penalty must be 'reward' (Tinker: into the advantages) or 'loss' (TRL: a loss "
                             f"term), got {self.kl_penalty!r}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0 (0: no penalty), got {self.kl_coef!r}")

    def loss_fn_config(self) -> dict:
        """The ``loss_fn_config`` of ``forward_backward``: the fields set here; the loss's defaults fill the rest."""
        if self.loss_fn in ("ppo", "cispo"):
            given = {"clip_low_threshold": self.clip_low, "clip_high_threshold": self.clip_high}
            return {k: v for k, v in given.items() if v is not None}
        if self.loss_fn == "dro":
            return {"beta": self.dro_beta}
        return {}

    def clip_range(self) -> tuple[float, float]:
        """The ratio range that counts toward ``optim/clip_fraction``: the loss's clip, else [0.8, 1.2]."""
        bounds = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
        if self.loss_fn in ("ppo", "cispo"):
            bounds.update(L.loss_fn_defaults(self.loss_fn))
        low = self.clip_low if self.clip_low is not None else bounds["clip_low_threshold"]
        high = self.clip_high if self.clip_high is not None else bounds["clip_high_threshold"]
        return low, high


@dataclass
class GRPOResult:
    """What :func:`train_grpo` (and its baseline :func:`continued_sft`) returns."""

    config: GRPOConfig
    metrics: pd.DataFrame
    """One row per step (metrics.jsonl)."""
    trainer: TrainingClient
    start: EvalResult | None
    """Held-out evaluation before the first step (None when resumed)."""
    final: EvalResult
    """Held-out evaluation after the last step."""


def _checkpoints(log_dir: Path) -> list[Path]:
    return sorted(p for p in (log_dir / "checkpoints").glob("step_*") if (p / "state.pt").exists())


def problem_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s problems and samples: a function of (seed, step), so resumed runs repeat."""
    return 1_000_003 * (seed + 1) + step


def make_training_client(config: GRPOConfig) -> tuple[TrainingClient, ChatMLRenderer, object]:
    """The trainer (from the SFT checkpoint or ``base_model``), the renderer and the task."""
    service = ServiceClient(device=pick_device(config.device), log_dir=config.log_dir)
    if config.base_model is None:
        model, tokenizer, _, _ = load_or_train_sft(replace(config.sft, seed=config.seed), progress=config.progress)
        base = (model, tokenizer)
    else:
        base = config.base_model
    if config.lora_rank is not None:
        trainer = service.create_lora_training_client(base, rank=config.lora_rank)
    else:
        trainer = service.create_training_client(base, keep_reference=config.kl_coef > 0 or config.log_kl_ref)
    return trainer, ChatMLRenderer(trainer.tokenizer), config.sft.task()


def train_grpo(config: GRPOConfig | None = None) -> GRPOResult:
    """Run GRPO; write ``log_dir/metrics.jsonl`` (and checkpoints). See the module docstring."""
    config = config or GRPOConfig()
    sampler = None  # the last step's sampler: reused only when config.refresh_sampler is False

    def step_fn(trainer, renderer, task, step):
        nonlocal sampler
        row = grpo_step(config, trainer, renderer, task, step, renderer.get_stop_sequences(), sampler)
        sampler = row.pop("_sampler")
        return row

    def on_resume(trainer, checkpoint):
        nonlocal sampler
        sampler = trainer.load_sampler(checkpoint)  # the stale sampler, when the run keeps one

    def sampler_to_save():
        return None if config.refresh_sampler else sampler

    return _run(config, step_fn, "GRPO", postfix="env/all/correct", on_resume=on_resume,
                sampler_to_save=sampler_to_save)


def continued_sft(config: GRPOConfig | None = None) -> GRPOResult:
    """The compute-matched baseline of ``train_grpo(config)``: the same start trained on the right answers.

    Everything GRPO's training half uses is kept: the trainer built from ``config``, Adam at
    ``learning_rate``, ``max_steps`` batches of ``batch_size * group_size`` sequences, each split into
    ``num_substeps`` optimizer steps, the ``aggregation`` and the held-out evaluation. Only the
    sequences differ: fresh training problems with their worked answers (``loss_fn="cross_entropy"``)
    instead of graded samples, and there is no sampling to pay for. This needs the answers; GRPO
    needs only the verifier. Writes ``log_dir/metrics.jsonl`` (``optim/loss``, ``optim/entropy``,
    ``test/pass_at_1``, ``time/train``); ``result.trainer`` holds the model.
    """
    config = config or GRPOConfig()
    if config.resume:
        raise ValueError("continued_sft starts fresh; set resume=False")
    n = config.batch_size * config.group_size

    def step_fn(trainer, renderer, task, step):
        t0 = time.perf_counter()
        problems = task.sample(n, split="train", seed=problem_seed(config.seed, step))
        datums = [build_supervised_datum(*demonstration_example(renderer, p)) for p in problems]
        rows = []
        for chunk in _substeps(datums, config.num_substeps):
            out = trainer.forward_backward(chunk, "cross_entropy", aggregation=config.aggregation,
                                           max_tokens=config.max_tokens).result()
            opt = trainer.optim_step(AdamParams(learning_rate=config.learning_rate)).result()
            rows.append({"optim/loss": out.loss, "optim/entropy": out.metrics["optim/entropy"], **opt})
        row = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
        return {**row, "time/train": time.perf_counter() - t0}

    return _run(replace(config, kl_coef=0.0, log_kl_ref=False), step_fn, "continued SFT", postfix="optim/loss")


def _substeps(datums: list, num_substeps: int) -> list[list]:
    """``datums`` cut into ``num_substeps`` consecutive slices (the last may be shorter), one optimizer step each."""
    size = -(-len(datums) // num_substeps)
    return [datums[k:k + size] for k in range(0, len(datums), size)]


def _run(config: GRPOConfig, step_fn, desc: str, postfix: str, on_resume=None, sampler_to_save=None) -> GRPOResult:
    """The loop around ``step_fn(trainer, renderer, task, step) -> metrics row``: resume, held-out
    evaluation every ``eval_every`` steps, ``metrics.jsonl``, checkpoints and a progress bar.
    ``on_resume(trainer, checkpoint)`` restores what the step function carries between steps, and
    ``sampler_to_save()`` names a sampler that every checkpoint must keep."""
    log_dir = Path(config.log_dir)
    with torch_threads(config.num_threads):
        trainer, renderer, task = make_training_client(config)
        test = task.sample(config.num_eval, split="test", seed=config.seed)
        start_step, start_eval = 0, None
        if config.resume and _checkpoints(log_dir):
            checkpoint = _checkpoints(log_dir)[-1]
            extra = trainer.load_state(checkpoint)
            if on_resume is not None:
                on_resume(trainer, checkpoint)
            start_step = extra["step"]
            truncate_metrics(log_dir, start_step)  # drop steps logged after the checkpoint
            logger = MetricsLogger(log_dir, if_exists="append")
        else:
            logger = MetricsLogger(log_dir, if_exists="overwrite")
            (log_dir / "config.json").write_text(json.dumps({"run": desc, **asdict(config)}, indent=1, default=str))
            start_eval = evaluate(trainer.model, renderer, test, max_tokens=config.max_tokens)
        bar = progress(range(start_step, config.max_steps), desc=desc, disable=not config.progress,
                       initial=start_step, total=config.max_steps)
        for step in bar:
            row = step_fn(trainer, renderer, task, step)
            if (step + 1) % config.eval_every == 0 or step + 1 == config.max_steps:
                ev = evaluate(trainer.model, renderer, test, max_tokens=config.max_tokens)
                row.update({"test/pass_at_1": ev.pass_at_1, "test/format": ev.format})
                bar.set_postfix({postfix.rsplit("/", 1)[-1]: f"{row[postfix]:.2f}", "test": f"{ev.pass_at_1:.2f}"},
                                refresh=False)
            if step == 0 and start_eval is not None:
                row.update({"test/start_pass_at_1": start_eval.pass_at_1})
            logger.log(step, **row)
            if config.save_every and (step + 1) % config.save_every == 0:
                trainer.save_state(f"step_{step + 1:06d}", extra={"step": step + 1},
                                   sampler=sampler_to_save() if sampler_to_save is not None else None)
        bar.close()
        logger.close()
        final = evaluate(trainer.model, renderer, test, max_tokens=config.max_tokens)
    return GRPOResult(config, load_metrics(log_dir), trainer, start_eval, final)


def grpo_step(config: GRPOConfig, trainer: TrainingClient, renderer: ChatMLRenderer, task, step: int, stop,
              sampler=None) -> dict:
    """One iteration (steps 1-6 of the module docstring). Returns the metrics row (and the sampler used)."""
    t0 = time.perf_counter()
    # 1. a sampler over the current weights (or the old one, for the stale-sampler demonstration)
    if sampler is None or config.refresh_sampler:
        sampler = trainer.save_weights_and_get_sampling_client(f"step_{step}")
    # 2. sample a group per problem
    problems = task.sample(config.batch_size, split="train", seed=problem_seed(config.seed, step))
    prompts = [renderer.build_generation_prompt(p.messages()) for p in problems]
    params = SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, stop=stop,
                            seed=problem_seed(config.seed, step))
    responses = sampler.sample_batch(prompts, config.group_size, params)
    t1 = time.perf_counter()
    # 3. rewards
    grades = []
    for problem, response in zip(problems, responses):
        for seq in response.sequences:
            message, ok = renderer.parse_response(seq.tokens)
            grades.append(grade(message["content"], problem.answer, complete=ok))
    P, G = config.batch_size, config.group_size
    rewards = torch.tensor([g.reward for g in grades], device="cpu").view(P, G)
    correct = torch.tensor([g.correct for g in grades], device="cpu").view(P, G)
    # 4. advantages
    adv = L.group_advantages(rewards, config.advantage_scale) if config.center_advantages else rewards.clone()
    keep = ~L.zero_variance_groups(rewards) if config.drop_uniform_groups else torch.ones(P, dtype=torch.bool, device="cpu")
    # 5. datums
    datums = [build_datum(prompts[i], seq.tokens, seq.logprobs, float(adv[i, j]))
              for i, response in enumerate(responses) if keep[i] for j, seq in enumerate(response.sequences)]
    kl_row = {}
    if datums and config.kl_coef > 0 and config.kl_penalty == "reward":
        datums, kl_row["env/all/kl_sample_ref"] = _kl_into_advantages(trainer, datums, config)
    # 6. forward_backward + optim_step, num_substeps times
    fwd_metrics: list[dict] = []
    loss_kl_coef = config.kl_coef if config.kl_penalty == "loss" else 0.0
    if datums:
        for chunk in _substeps(datums, config.num_substeps):
            out = trainer.forward_backward(chunk, config.loss_fn, config.loss_fn_config(),
                                           aggregation=config.aggregation, max_tokens=config.max_tokens,
                                           temperature=config.temperature, kl_coef=loss_kl_coef,
                                           kl_estimator=config.kl_estimator, clip_range=config.clip_range(),
                                           log_kl_ref=config.kl_coef > 0 or config.log_kl_ref).result()
            opt = trainer.optim_step(AdamParams(learning_rate=config.learning_rate)).result()
            fwd_metrics.append({**out.metrics, **opt, "optim/loss": out.loss})
    t2 = time.perf_counter()
    uniform = rewards.max(1).values == rewards.min(1).values
    row = {
        "env/all/reward/total": float(rewards.mean()),
        "env/all/correct": float(correct.mean()),
        "env/all/format": float(sum(g.format for g in grades) / len(grades)),
        "env/all/ac_tokens_per_turn": sum(len(s.tokens) for r in responses for s in r.sequences) / (P * G),
        "env/all/by_group/frac_mixed": float((~uniform).float().mean()),
        "env/all/by_group/frac_all_good": float((correct.min(1).values == 1).float().mean()),
        "env/all/by_group/frac_all_bad": float((correct.max(1).values == 0).float().mean()),
        **kl_row,
        "time/sample": t1 - t0,
        "time/train": t2 - t1,
    }
    for key in (fwd_metrics[0] if fwd_metrics else {}):
        row[key] = sum(m[key] for m in fwd_metrics) / len(fwd_metrics)
    if fwd_metrics:  # the last substep's ratio is the one furthest from 1
        row["optim/clip_fraction_last_substep"] = fwd_metrics[-1]["optim/clip_fraction"]
    row["_sampler"] = sampler
    return row


def _kl_into_advantages(trainer: TrainingClient, datums: list, config: GRPOConfig) -> tuple[list, float]:
    """Tinker's KL penalty: each action token's advantage gets kl_coef * (mean k1 - k1), k1 = log q - log p_ref
    (see :func:`edurl.llm.losses.kl_penalty_advantages`). Returns new datums and the batch's mean k1."""
    ref = trainer.compute_logprobs(datums, reference=True, temperature=config.temperature)
    fields = [d.loss_fn_inputs for d in datums]
    cat = {k: torch.cat([f[k] for f in fields]) for k in ("advantages", "logprobs", "mask")}
    advantages, mean_k = L.kl_penalty_advantages(cat["advantages"], cat["logprobs"], torch.cat(ref), cat["mask"],
                                                 config.kl_coef)
    pieces = advantages.split([d.model_input.length for d in datums])
    return [Datum(d.model_input, {**d.loss_fn_inputs, "advantages": a}) for d, a in zip(datums, pieces)], float(mean_k)


#: the panels of :func:`plot_grpo_metrics`: (metric, title)
GRPO_PANELS = (("env/all/correct", "train correct (sampled, T=1)"), ("test/pass_at_1", "held-out pass@1 (greedy)"),
               ("env/all/format", "format"), ("optim/entropy", "entropy (nats / token)"),
               ("env/all/by_group/frac_mixed", "frac_mixed (groups with signal)"),
               ("optim/kl_sample_train_v2", "kl_sample_train_v2"))


def plot_grpo_metrics(runs, panels=GRPO_PANELS, smooth: int = 10):
    """Learning curves of one or more runs: ``runs`` is a metrics DataFrame or ``{label: DataFrame}``.

    Per-step training metrics are drawn as a rolling mean over ``smooth`` steps; evaluations as points.
    """
    import matplotlib.pyplot as plt

    if isinstance(runs, pd.DataFrame):
        runs = {"": runs}
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols, 3.1 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        for label, m in runs.items():
            if key not in m:
                continue
            data = m[["step", key]].dropna()
            if key.startswith("test/"):
                ax.plot(data["step"], data[key], marker="o", label=label or None)
            else:
                ax.plot(data["step"], data[key].rolling(smooth, min_periods=1).mean(), label=label or None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if len(runs) > 1:
        axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


__all__ = ["GRPOConfig", "GRPOResult", "GRPO_PANELS", "continued_sft", "grpo_step", "make_training_client",
           "plot_grpo_metrics", "problem_seed", "train_grpo"]
