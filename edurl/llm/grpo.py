"""GRPO on verifiable tasks, written with the local Tinker-style clients (Chapter 7).

One iteration is the seven steps of the reference loop::

    1. sampler = trainer.save_weights_and_get_sampling_client(...)   fresh weights every step
    2. sample G completions for each of P problems                   (P*G sequences, with log-probs)
    3. grade them: reward = correct + 0.1 * (format - 1)             rewards (P, G) (or reward_fn's, Chapter 8)
    4. advantages = rewards - group mean                             (P, G); 0 for a uniform group
    5. one Datum per completion (prompt masked, advantage on every action token)
    6. forward_backward(datums, loss_fn) then optim_step, num_substeps times over slices of the batch
    7. log the metrics; every eval_every steps, greedy pass@1 on held-out problems

The file reads top to bottom: :class:`GRPOConfig`, then :func:`grpo_step` (one iteration, which calls
:func:`edurl.llm.losses.rl_objective` through ``forward_backward``), then :func:`train_grpo` (the loop), then
helpers. The loop itself (resume, evaluation, logging, checkpoints) is :mod:`edurl.llm.loop`.

``train_grpo`` resumes from the newest checkpoint in ``log_dir`` when ``resume=True``; problems and
sampling seeds are functions of (seed, step), and a checkpoint holds everything else the loop carries
(weights, Adam's moments, and the stale sampler when ``refresh_sampler=False``), so on a CPU a resumed
run repeats an uninterrupted one exactly, even after a kill at any moment.

A KL penalty to the starting policy (``kl_coef > 0``) goes into the reward by default, as in Tinker
(``kl_penalty="reward"``, see :func:`edurl.llm.losses.kl_penalty_advantages`); ``kl_penalty="loss"``
adds it to the loss instead, as TRL does.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from edurl._checks import check_fields
from edurl.llm import losses as L
from edurl.llm.clients import AdamParams, SamplingClient, TrainingClient
from edurl.llm.datum import Datum, build_datums
from edurl.llm.distributed import SINGLE, World, init_world, loss_share
from edurl.llm.loop import (
    GRPOResult,
    check_lora_rank,
    group_seed,
    make_training_client,
    problem_seed,
    run_training_loop,
    substeps,
)
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.rewards import grade
from edurl.llm.sampling import SamplingParams
from edurl.llm.sft import SFTConfig
from edurl.objectives import check_clip_range
from edurl.utils import warn_at_caller


class CompletionTokens(list):
    """One completion's token ids, a plain ``list`` of ints, that also carries the sampler's ``stop_reason``
    (``"stop"``: it ended on a stop token; ``"length"``: ``max_tokens`` cut it off). Pass it on to
    ``renderer.parse_response(tokens, tokens.stop_reason)``: the ids alone cannot tell a reply that ended on one of
    the model's end-of-sequence tokens from one cut off there (Qwen2.5-Instruct stops on ``<|endoftext|>`` too).
    A slice or a copy made by ``list`` (``tokens[:-1]``, ``list(tokens)``) is a plain list without it: read
    ``stop_reason`` from the completion itself."""

    def __init__(self, tokens, stop_reason: str | None = None):
        super().__init__(tokens)
        self.stop_reason = stop_reason


RewardFn = Callable[[list, list[list[int]], list[list[list[int]]]], "torch.Tensor | tuple[torch.Tensor, dict]"]
"""A reward in place of the verifier's: ``reward_fn(problems, prompts, completions)`` with the step's P problems,
their P rendered prompts (token ids) and the G completions of each (token ids, ending with the stop token when they
stopped; each a :class:`CompletionTokens`, a list of ints with the sampler's ``stop_reason`` as an attribute)
returns the rewards, shape (P, G), or ``(rewards, metrics)`` where ``metrics`` is a dict of floats logged
with the step (e.g. ``env/all/reward/gold``). See :class:`edurl.llm.preference.RewardModelReward`. Under torchrun
each rank calls it with its own share of the P problems, so a reward that compares or normalises across the batch
sees only that share, and its metrics, averaged over the ranks by name, must have the same names on every rank."""


@dataclass
class GRPOConfig:
    """Settings of a GRPO run on the course's arithmetic task (every field is a recipe flag)."""

    sft: SFTConfig = field(default_factory=SFTConfig)
    """The warm start (Chapter 6), loaded from the SFT cache or trained once. Its task is the RL task."""
    base_model: str | None = None
    """A model folder or hub id to start from instead of the SFT checkpoint (e.g. a real chat model)."""
    lora_rank: int | None = None
    """None trains every weight; an int trains a peft LoRA adapter of that rank."""
    group_size: int = 4
    """G: completions per problem. 4, not 8: 300 steps learn about as much as with 8 in about 0.6 times the
    seconds, and 16 problems x 8 learn less per second (Chapter 7, "Four samples a problem, not eight")."""
    batch_size: int = 32
    """P: problems per step."""
    max_steps: int = 350
    """GRPO iterations. 350 fit Chapter 7's minute of training on a 2-core CPU (38-61 s over seeds 0-9, two runs),
    and gained a median 38.75 points of held-out pass@1 there (2 threads: 8 of 10 seeds at +30 or more by step 350,
    4 of 10 by step 300; the 1-thread study: 6 of 10; Chapter 7, "The real run, and what it measures")."""
    learning_rate: float = 3e-4
    """Adam learning rate (constant)."""
    loss_fn: str = "importance_sampling"
    """importance_sampling, ppo, cispo or dro (see edurl.llm.losses)."""
    clip_low_threshold: float | None = None
    """Lower bound of the ratio in ppo's and cispo's clip (Tinker's loss_fn_config key); None: the loss's own
    default (ppo 0.8, cispo 0.0). optim/clip_fraction counts ratios outside the same range."""
    clip_high_threshold: float | None = None
    """Upper bound of the ratio in ppo's and cispo's clip; None: the loss's own default (ppo 1.2, cispo 4.0)."""
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
    score_zero_advantage: bool = False
    """``TrainingClient.score_zero_advantage``. False (the recipe): datums whose advantages are all 0 get no forward
    or backward pass but keep their tokens in the loss's denominator, so the update is the same; ``optim/entropy``,
    ``optim/kl_sample_train_*`` and ``optim/clip_fraction`` then cover the datums with a gradient, as in Tinker's
    ``rl_loop``, which leaves uniform groups out. True scores them too (without a graph): metrics over every datum."""
    refresh_sampler: bool = True
    """False keeps the first step's sampler for the whole run: the stale-sampler mistake."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scores at the same one, so the ratio is exactly 1 on-policy."""
    max_tokens: int = 16
    """Most tokens per completion; also the fixed budget that Dr. GRPO's aggregation divides by."""
    sample_per_problem: bool = False
    """Sample each problem's group in a call of its own, seeded by (seed, step, problem), rather than the whole
    batch in one call: the samples then do not depend on how the batch is split, so a data-parallel run under
    torchrun (which turns this on) repeats a single-process run with this flag. Slower on one process."""
    max_steps_off_policy: int | None = None
    """None: every batch is sampled with the current weights (on-policy). k >= 0: batch s is sampled with the
    weights of step s - k, as by a sampler that runs k steps ahead of the trainer (Chapter 10,
    :mod:`edurl.llm.off_policy`); 0 is the synchronous loop."""
    concurrent_sampler: bool = True
    """With max_steps_off_policy: sample in a thread of its own, beside the trainer (the two overlap when k >= 1;
    give each num_threads = cores / 2). The batches are the same as with False, which samples in turn."""
    sampler_process: bool = False
    """With max_steps_off_policy: sample in a second process instead of a thread (:class:`edurl.llm.off_policy.
    ProcessSampler`), so the sampler does not share the trainer's Python interpreter lock. Same batches. The
    model, renderer, task and reward_fn must pickle (a module-level reward_fn, not a lambda)."""
    eval_every: int = 25
    """Steps between held-out evaluations (greedy pass@1); also at the start and the end."""
    num_eval: int = 200
    """Held-out test problems per evaluation."""
    save_every: int = 0
    """Steps between checkpoints (0: none)."""
    resume: bool = False
    """Continue from the newest checkpoint in log_dir."""
    overwrite: bool = False
    """Start afresh in a log_dir that holds an earlier run, deleting its checkpoints and metrics first; without it a
    fresh run refuses a log_dir with checkpoints, so that no run is lost or mixed into another by accident."""
    log_dir: str = "runs/grpo_arithmetic"
    """Where metrics.jsonl and checkpoints go."""
    seed: int = 0
    """Seeds everything: the SFT warm start, the LoRA adapter (with lora_rank), the problems and the sampling.
    The warm start is trained with sft.seed = seed; an sft.seed other than seed is refused rather than silently
    replaced, except 0, SFTConfig's default, which cannot be told from one left unset."""
    num_threads: int = 2
    """torch CPU threads."""
    device: str | None = None
    """Where the policy trains and samples: "cpu", "cuda", ...; None picks with edurl.device()."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        check_fields(  # and every bool field is a bool; a bool is no count (True was taken as 1)
            self,
            positive_int=(
                "group_size",
                "batch_size",
                "max_steps",
                "num_substeps",
                "max_tokens",
                "num_eval",
                "num_threads",
            ),
            nonneg_int=("seed", "eval_every", "save_every", "max_steps_off_policy"),
            optional=("num_threads", "max_steps_off_policy"),
        )
        if isinstance(self.log_dir, os.PathLike):
            self.log_dir = os.fspath(self.log_dir)  # a pathlib.Path, as a str (config.json holds it)
        if not isinstance(self.log_dir, str) or not self.log_dir:
            raise ValueError(f"GRPOConfig.log_dir must be a folder path, got {self.log_dir!r}")
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2: a group of one has advantage 0 after centring")
        if self.resume and self.overwrite:
            raise ValueError("resume=True continues the run in log_dir and overwrite=True deletes it: set one of them")
        if self.batch_size * self.group_size % self.num_substeps:
            raise ValueError(
                f"num_substeps ({self.num_substeps}) must divide batch_size * group_size "
                f"({self.batch_size * self.group_size})"
            )
        L.get_loss_fn(self.loss_fn)
        if self.aggregation not in L.AGGREGATION_MODES:
            raise ValueError(f"aggregation must be one of {L.AGGREGATION_MODES}, got {self.aggregation!r}")
        if self.advantage_scale not in L.ADVANTAGE_SCALES:
            raise ValueError(f"advantage_scale must be one of {L.ADVANTAGE_SCALES}, got {self.advantage_scale!r}")
        if self.kl_estimator not in L.KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {L.KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.kl_penalty not in L.KL_PENALTIES:
            raise ValueError(
                f"kl_penalty must be 'reward' (Tinker: into the advantages) or 'loss' (TRL: a loss "
                f"term), got {self.kl_penalty!r}"
            )
        for name in ("kl_coef", "temperature", "learning_rate"):  # True was 1.0, and "1.0" a TypeError below
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"GRPOConfig.{name} must be a number, got {value!r}")
        if not (self.kl_coef >= 0 and math.isfinite(self.kl_coef)):  # inf made every penalised loss inf or NaN
            raise ValueError(f"kl_coef must be a finite number >= 0 (0: no penalty), got {self.kl_coef!r}")
        if isinstance(self.dro_beta, bool) or not (
            isinstance(self.dro_beta, numbers.Real) and math.isfinite(self.dro_beta) and self.dro_beta >= 0
        ):
            raise ValueError(
                f"dro_beta must be a finite number >= 0 (the dro loss's quadratic penalty, e.g. 0.05), got "
                f"{self.dro_beta!r}: a negative one fails in the loss at the first step, and inf makes every loss NaN"
            )
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0, got {self.temperature!r}: GRPO samples G completions of each problem and "
                "learns from how they differ, and greedy sampling (0) makes them all the same, so every group is "
                "uniform and nothing is learned. Held-out evaluation is greedy already."
            )
        if not (1e-6 <= self.temperature < math.inf):  # the sampler's own limits, checked before the warm start
            raise ValueError(
                f"temperature must be a finite number >= 1e-6 (the course samples at 1.0), got {self.temperature!r}: "
                "below 1e-6 the sampler refuses it (logits / temperature can overflow), and at inf every token is "
                "equally likely and the trainer's log-probs carry no gradient"
            )
        if not (self.learning_rate >= 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be a finite number >= 0, got {self.learning_rate!r}")
        if self.eval_every == 0:
            raise ValueError("eval_every must be >= 1 (steps between held-out evaluations)")
        if self.max_steps_off_policy is not None and not self.refresh_sampler:
            raise ValueError(
                "refresh_sampler=False keeps the first sampler for the whole run, but max_steps_off_policy "
                "chooses the sampler's weights itself; set one of them"
            )
        if self.sampler_process and (self.max_steps_off_policy is None or not self.concurrent_sampler):
            raise ValueError(
                "sampler_process=True runs the off-policy sampler beside the trainer in a process of its own; it "
                "needs max_steps_off_policy set (e.g. 1) and concurrent_sampler=True"
            )
        check_lora_rank(self.lora_rank)
        if self.sft.seed not in (0, self.seed):
            raise ValueError(
                f"sft.seed={self.sft.seed} but seed={self.seed}: GRPO's seed also seeds its SFT warm "
                f"start, so set only seed (here seed={self.sft.seed}), or leave sft.seed at 0."
            )
        if self.clip_low_threshold is not None or self.clip_high_threshold is not None:
            if self.loss_fn not in ("ppo", "cispo"):  # they were dropped without a word: the loss has no clip
                raise ValueError(
                    f"clip_low_threshold and clip_high_threshold set the clip of loss_fn 'ppo' or 'cispo', but "
                    f"loss_fn is {self.loss_fn!r}, which has none (optim/clip_fraction then counts against PPO's "
                    "[0.8, 1.2]); set loss_fn='ppo' (or 'cispo'), or leave both thresholds at None"
                )
            check_clip_range(*L.clip_bounds(self.loss_fn, self.loss_fn_config()))  # low <= 1 <= high

    def loss_fn_config(self) -> dict:
        """The ``loss_fn_config`` of ``forward_backward``: the fields set here; the loss's defaults fill the rest."""
        if self.loss_fn in ("ppo", "cispo"):
            given = {"clip_low_threshold": self.clip_low_threshold, "clip_high_threshold": self.clip_high_threshold}
            return {k: v for k, v in given.items() if v is not None}
        if self.loss_fn == "dro":
            return {"beta": self.dro_beta}
        return {}


@dataclass
class Rollout:
    """One step's batch, sampled, graded and turned into datums (steps 2-5): what the sampler hands the trainer."""

    step: int
    """The step whose problems these are."""
    datums: list[Datum]
    """This rank's datums, advantages in place."""
    row: dict[str, float]
    """The batch's ``env/*`` metrics (the whole batch's, under data parallelism) and ``time/sample``."""
    sampler_version: int | None = None
    """How many optimizer steps the sampler's weights had taken (set by the off-policy loop)."""


def collect(
    config: GRPOConfig,
    sampler: SamplingClient,
    renderer: ChatMLRenderer,
    task,
    step: int,
    stop,
    reward_fn: RewardFn | None = None,
    world: World = SINGLE,
) -> Rollout:
    """Steps 2-5 of the module docstring with ``sampler``: sample a group per problem, grade, centre, build datums.

    ``reward_fn`` replaces the verifier's reward in step 3 (see :data:`RewardFn`): Chapter 8 passes a learned
    reward model. The verifier still grades every completion for the ``env/all/correct`` and ``format`` metrics.
    ``world`` (:mod:`edurl.llm.distributed`) splits the batch over data-parallel ranks: each samples and grades
    its share of the problems, and the advantages and metrics are those of the whole batch."""
    t0 = time.perf_counter()
    # 2. sample a group per problem
    P, G = config.batch_size, config.group_size
    problems = task.sample(P, split="train", seed=problem_seed(config.seed, step))
    mine = world.shard(P)  # this rank's problems (all of them on one process)
    prompts = [renderer.build_generation_prompt(problems[i].messages()) for i in mine]
    params = SamplingParams(
        max_tokens=config.max_tokens, temperature=config.temperature, stop=stop, seed=problem_seed(config.seed, step)
    )
    if config.sample_per_problem or world.size > 1:  # one call per group, seeded by its problem: any split agrees
        responses = [
            sampler.sample_batch([prompt], G, replace(params, seed=group_seed(params.seed, i)))[0]
            for i, prompt in zip(mine, prompts)
        ]
    else:
        responses = sampler.sample_batch(prompts, G, params)
    # 3. rewards
    grades = []
    for i, response in zip(mine, responses):
        for seq in response.sequences:
            message, ok = renderer.parse_response(seq.tokens, seq.stop_reason)
            grades.append(grade(message["content"], problems[i].answer, complete=ok))
    rewards = torch.tensor([g.reward for g in grades], device="cpu").view(len(mine), G)
    reward_row = {}
    if reward_fn is not None:
        rewards, reward_row = _call_reward_fn(reward_fn, [problems[i] for i in mine], prompts, responses, rewards.shape)
    correct = torch.tensor([g.correct for g in grades], device="cpu").view(len(mine), G)
    rewards, correct = world.gather_rows(rewards, P), world.gather_rows(correct, P)  # (P, G): the whole batch
    # 4. advantages
    adv = L.group_advantages(rewards, config.advantage_scale) if config.center_advantages else rewards.clone()
    keep = (
        ~L.zero_variance_groups(rewards)
        if config.drop_uniform_groups
        else torch.ones(P, dtype=torch.bool, device="cpu")
    )
    # 5. datums
    kept = [
        (prompt, seq, float(adv[i, j]))
        for i, prompt, response in zip(mine, prompts, responses)
        if keep[i]
        for j, seq in enumerate(response.sequences)
    ]
    datums = build_datums(
        [p for p, _, _ in kept], [s.tokens for _, s, _ in kept], [s.logprobs for _, s, _ in kept], [a for *_, a in kept]
    )
    uniform = rewards.max(1).values == rewards.min(1).values
    formats, tokens = world.sum_floats(
        [sum(g.format for g in grades), sum(len(s.tokens) for r in responses for s in r.sequences)]
    )
    row = {
        "env/all/reward/total": float(rewards.mean()),
        "env/all/correct": float(correct.mean()),
        "env/all/format": float(formats / (P * G)),
        "env/all/ac_tokens_per_turn": tokens / (P * G),
        "env/all/by_group/frac_mixed": float((~uniform).float().mean()),
        "env/all/by_group/frac_all_good": float((correct.min(1).values == 1).float().mean()),
        "env/all/by_group/frac_all_bad": float((correct.max(1).values == 0).float().mean()),
        **world.mean(reward_row),
        "time/sample": time.perf_counter() - t0,
    }
    return Rollout(step, datums, row)


def update(config: GRPOConfig, trainer: TrainingClient, rollout: Rollout, world: World = SINGLE) -> dict[str, float]:
    """Step 6 on a :class:`Rollout`: the KL penalty (if any), then forward_backward and optim_step,
    ``num_substeps`` times. Returns the step's metrics row: the rollout's, ``optim/*`` and ``time/train``."""
    t1 = time.perf_counter()
    datums = rollout.datums
    kl_row = {}
    if datums and config.kl_coef > 0 and config.kl_penalty == "reward":
        datums, kl_row["env/all/kl_sample_ref"] = kl_into_advantages(
            trainer, datums, config.kl_coef, config.temperature
        )
    fwd_metrics: list[dict] = []
    loss_kl_coef = config.kl_coef if config.kl_penalty == "loss" else 0.0
    if datums:  # on every rank, under data parallelism (which refuses drop_uniform_groups)
        for chunk in substeps(datums, config.num_substeps):
            out = trainer.forward_backward(
                chunk,
                config.loss_fn,
                config.loss_fn_config(),
                aggregation=config.aggregation,
                max_tokens=config.max_tokens,
                temperature=config.temperature,
                kl_coef=loss_kl_coef,
                kl_estimator=config.kl_estimator,
                log_kl_ref=config.kl_coef > 0 or config.log_kl_ref,
            ).result()
            share = loss_share(chunk, config.aggregation, world)  # 1 on one process
            world.all_reduce_gradients(trainer.trainable_parameters(), share)
            opt = trainer.optim_step(AdamParams(learning_rate=config.learning_rate)).result()
            loss = world.sum(share * out.loss)  # the loss on the whole batch
            metrics = world.token_mean(out.metrics, chunk, out.metric_tokens, out.all_zero_advantage)
            fwd_metrics.append({**metrics, **opt, "optim/loss": loss})
    row = {**rollout.row, **kl_row, "time/train": time.perf_counter() - t1}
    for key in fwd_metrics[0] if fwd_metrics else {}:
        row[key] = sum(m[key] for m in fwd_metrics) / len(fwd_metrics)
    if fwd_metrics:  # the last substep's ratio is the one furthest from 1
        row["optim/clip_fraction_last_substep"] = fwd_metrics[-1]["optim/clip_fraction"]
    return row


def grpo_step(
    config: GRPOConfig,
    trainer: TrainingClient,
    renderer: ChatMLRenderer,
    task,
    step: int,
    stop,
    sampler: SamplingClient | None = None,
    reward_fn: RewardFn | None = None,
    world: World = SINGLE,
) -> tuple[dict[str, float], SamplingClient]:
    """One iteration: a sampler (step 1), :func:`collect` (steps 2-5) and :func:`update` (step 6). Returns the
    metrics row and the sampler it used (pass that sampler back in to keep it, the stale-sampler mistake, with
    ``refresh_sampler=False``). ``reward_fn`` and ``world`` are :func:`collect`'s."""
    # 1. a sampler over the current weights (or the old one, for the stale-sampler demonstration)
    if sampler is None or config.refresh_sampler:
        sampler = trainer.save_weights_and_get_sampling_client(f"step_{step}")
    rollout = collect(config, sampler, renderer, task, step, stop, reward_fn, world)
    return update(config, trainer, rollout, world), sampler


def train_grpo(config: GRPOConfig | None = None, step_fn=None, reward_fn: RewardFn | None = None) -> GRPOResult:
    """Run GRPO; write ``log_dir/metrics.jsonl`` (and checkpoints). See the module docstring.

    ``reward_fn`` replaces the verifier's reward at every step (see :data:`RewardFn`; Chapter 8's reward model).

    ``step_fn(config, trainer, renderer, task, step) -> dict`` replaces :func:`grpo_step` for every step: Chapter
    7's capstone passes the learner's own. It returns the step's metrics row (``env/all/correct`` is shown on the
    progress bar when present) and must do all of steps 1-6 itself, with a fresh sampler each step; the config
    fields that only :func:`grpo_step` reads (``refresh_sampler``, the KL penalty, ...) are then the step's to honour.
    """
    config = config or GRPOConfig()
    world = init_world(config.device)  # SINGLE unless started by torchrun with more than one process
    if world.size > 1:
        config = replace(config, sample_per_problem=True)
        _check_data_parallel(config, world, step_fn)
    if config.max_steps_off_policy is not None:
        if step_fn is not None:
            raise ValueError("a step_fn runs its own sampler; leave max_steps_off_policy at None with step_fn")
        return _train_off_policy(config, reward_fn)
    if step_fn is not None:
        if not callable(step_fn):
            raise TypeError(
                f"step_fn must be a function step_fn(config, trainer, renderer, task, step) -> dict of metrics, "
                f"got {type(step_fn).__name__}"
            )
        if reward_fn is not None:
            raise ValueError(
                "step_fn computes its own rewards, so reward_fn cannot be used with it; pass one or the other"
            )
        if not config.refresh_sampler:
            raise ValueError(
                "refresh_sampler=False keeps grpo_step's stale sampler between steps, but a step_fn makes its own "
                "sampler; leave refresh_sampler=True with step_fn."
            )

        def own_step(trainer, renderer, task, step):
            row = step_fn(config, trainer, renderer, task, step)
            if not isinstance(row, dict):
                raise TypeError(
                    f"step_fn returned {type(row).__name__}; it must return the step's metrics as a dict, e.g. "
                    '{"env/all/correct": 0.5, "env/all/reward/total": 0.45}'
                )
            return dict(row)

        return run_training_loop(config, own_step, "GRPO", postfix="env/all/correct")

    sampler = None  # the last step's sampler: reused only when config.refresh_sampler is False

    def library_step(trainer, renderer, task, step):
        nonlocal sampler
        row, sampler = grpo_step(
            config, trainer, renderer, task, step, renderer.get_stop_sequences(), sampler, reward_fn, world
        )
        return row

    def on_resume(trainer, checkpoint, extra):
        nonlocal sampler
        sampler = trainer.load_sampler(checkpoint)  # the stale sampler, when the run keeps one

    def sampler_to_save():
        return None if config.refresh_sampler else sampler

    return run_training_loop(
        config,
        library_step,
        "GRPO",
        postfix="env/all/correct",
        on_resume=on_resume,
        sampler_to_save=sampler_to_save,
        world=world,
    )


def _train_off_policy(config: GRPOConfig, reward_fn: RewardFn | None) -> GRPOResult:
    """train_grpo with a sampler ``max_steps_off_policy`` steps behind the trainer (:mod:`edurl.llm.off_policy`)."""
    from edurl.llm.off_policy import SamplerProcess, check_snapshots, make_lagged_sampler, spawn_payload

    if config.sampler_process:
        spawn_payload(reward_fn)  # a lambda or a notebook's function is refused now, not after the warm start
    if config.max_steps_off_policy >= config.max_steps > 1:
        warn_at_caller(
            f"max_steps_off_policy={config.max_steps_off_policy} >= max_steps={config.max_steps}: every batch is "
            "sampled with the starting weights, and the run keeps a copy of the trainable weights for every step "
            "(in memory and in each checkpoint), as a resume with a larger max_steps may need them. "
            "refresh_sampler=False (with max_steps_off_policy=None) gives exactly this run and keeps one copy."
        )
    lagged, restored, first = None, {}, []
    process = SamplerProcess() if config.sampler_process else None  # its start-up overlaps the trainer's

    def start(trainer, renderer, task, step):
        nonlocal lagged
        lagged = make_lagged_sampler(config, trainer, renderer, task, reward_fn, step, restored, process)
        first.append(step)

    def off_policy_step(trainer, renderer, task, step):
        rollout, waited = lagged.next(step)
        row = update(config, trainer, rollout)
        lagged.publish(step + 1)
        row = {**row, "async/staleness": float(step - rollout.sampler_version), "time/wait": waited}
        if step == first[0] and hasattr(lagged, "start_seconds"):  # outside time/step, as the trainer's start-up
            row["time/sampler_start"] = lagged.start_seconds
        return row

    def on_resume(trainer, checkpoint, extra):  # checked now, before the first evaluation and the sampler's start
        restored.update(check_snapshots(config.max_steps_off_policy, extra["step"], extra.get("snapshots", {})))

    def extra_to_save(next_step):
        return {"snapshots": lagged.state(next_step)}

    try:
        return run_training_loop(
            config,
            off_policy_step,
            "GRPO",
            postfix="env/all/correct",
            on_resume=on_resume,
            extra_to_save=extra_to_save,
            on_start=start,
        )
    finally:
        if lagged is not None:
            lagged.close()
        elif process is not None:
            process.close()


# ---------------------------------------------------------------- helpers


def _check_data_parallel(config: GRPOConfig, world: World, step_fn) -> None:
    """Refuse, before any work, the settings that data-parallel GRPO does not split exactly."""
    if step_fn is not None:
        raise ValueError(
            f"train_grpo was started by torchrun with {world.size} processes, but a step_fn does not know how to "
            "split a batch across them; run a step_fn on one process (python, not torchrun)"
        )
    if config.batch_size % (world.size * config.num_substeps):
        raise ValueError(
            f"batch_size={config.batch_size} must be a multiple of nproc_per_node x num_substeps = "
            f"{world.size} x {config.num_substeps}, so every rank holds the same share of every substep; "
            f"e.g. --batch-size {-(-config.batch_size // (world.size * config.num_substeps)) * world.size * config.num_substeps}"
        )
    if config.max_steps_off_policy is not None:
        raise ValueError(
            "max_steps_off_policy (a sampler that runs ahead) is not supported under torchrun yet; run it on one "
            "process, or leave it at None"
        )
    if config.drop_uniform_groups:
        raise ValueError(
            "drop_uniform_groups is not supported under torchrun yet (a rank could be left with no datums); "
            "run it on one process, or leave it off: a uniform group's advantages are 0 anyway"
        )
    if config.kl_coef > 0 and config.kl_penalty == "reward":
        raise ValueError(
            "kl_penalty='reward' centres the KL on the batch's mean, which is not split across ranks yet; under "
            "torchrun use --kl-penalty loss, or run on one process"
        )


def _call_reward_fn(reward_fn, problems, prompts, responses, shape) -> tuple[torch.Tensor, dict[str, float]]:
    """``reward_fn``'s rewards as a float32 (P, G) tensor on the CPU, and its metrics, checked."""
    completions = [[CompletionTokens(seq.tokens, seq.stop_reason) for seq in r.sequences] for r in responses]
    out = reward_fn(problems, prompts, completions)
    rewards, metrics = out if isinstance(out, tuple) else (out, {})
    rewards = torch.as_tensor(rewards, dtype=torch.float32).detach().cpu()
    if tuple(rewards.shape) != shape:
        raise ValueError(
            f"reward_fn returned rewards of shape {tuple(rewards.shape)}; it must return one per completion, "
            f"shape (problems, group_size) = {shape} (under torchrun, this rank's share of the batch_size problems)"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("reward_fn returned a NaN or infinite reward; every reward must be a finite number")
    return rewards, {k: float(v) for k, v in dict(metrics).items()}


def kl_into_advantages(
    trainer: TrainingClient, datums: list, kl_coef: float, temperature: float = 1.0
) -> tuple[list, float]:
    """Tinker's KL penalty: each action token's advantage gets kl_coef * (mean k1 - k1), k1 = log q - log p_ref
    (see :func:`edurl.llm.losses.kl_penalty_advantages`); the trainer needs a reference model. Returns new datums
    and the batch's mean k1."""
    ref = trainer.compute_logprobs(datums, reference=True, temperature=temperature)
    fields = [d.loss_fn_inputs for d in datums]
    cat = {k: torch.cat([f[k] for f in fields]) for k in ("advantages", "logprobs", "mask")}
    advantages, mean_k = L.kl_penalty_advantages(
        cat["advantages"], cat["logprobs"], torch.cat(ref), cat["mask"], kl_coef
    )
    pieces = advantages.split([d.model_input.length for d in datums])
    return [Datum(d.model_input, {**d.loss_fn_inputs, "advantages": a}) for d, a in zip(datums, pieces)], float(mean_k)


__all__ = [
    "CompletionTokens",
    "GRPOConfig",
    "GRPOResult",
    "RewardFn",
    "Rollout",
    "collect",
    "grpo_step",
    "kl_into_advantages",
    "update",
    "make_training_client",
    "problem_seed",
    "train_grpo",
]
