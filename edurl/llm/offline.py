"""Offline RL from a buffer of logged rollouts, with DRO (Chapter 10).

Online GRPO samples every batch from the policy it trains. Offline, the samples were drawn earlier, by other
policies (here the SFT start and a few GRPO checkpoints), and kept with what the loss needs: the prompt, each
completion's tokens and its log-probs under the policy that sampled it, and its reward. Training then never
samples::

    buffer = collect_buffer({"sft": sft_sampler, "grpo@50": ckpt_sampler}, renderer, task, num_groups=256)
    buffer.save("runs/buffer.pt")
    result = train_offline(GRPOConfig(loss_fn="dro", dro_beta=0.1, ...), buffer)

The loss must tolerate samples from a policy far from the one being trained. DRO (Richemond et al., 2024; the
Kimi k1.5 report, 2025) does it with two pieces, both here:

- the *soft* advantage, ``R - beta * log mean exp(R / beta)`` over the group
  (:func:`edurl.llm.losses.soft_advantages`), which the client computes, as Tinker's docs say (here optional:
  GRPO's mean baseline learned more in Chapter 10's study, see :func:`offline_step`);
- the loss ``-(log pi * A - beta / 2 * (log pi - log q)**2)`` (:func:`edurl.llm.losses.dro`), whose quadratic
  penalty keeps the policy near the sampler ``q`` of each logged token. With ``beta -> 0`` nothing does.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from edurl.llm import losses as L
from edurl.llm.clients import SamplingClient
from edurl.llm.datum import build_datum
from edurl.llm.grpo import GRPOConfig, Rollout, update
from edurl.llm.loop import GRPOResult, problem_seed, run_training_loop
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.rewards import grade
from edurl.llm.sampling import SamplingParams
from edurl.utils import file_in_the_way, progress, warn_at_caller

__all__ = ["ADVANTAGES", "RolloutBuffer", "collect_buffer", "draw_groups", "offline_step", "train_offline"]

ADVANTAGES = ("mean", "soft")


@dataclass
class RolloutBuffer:
    """Groups of completions sampled by earlier policies: group i is ``group_size`` completions of
    ``prompts[i]``, each with its tokens, its sampler's log-probs, its reward and whether it was correct."""

    prompts: list[list[int]] = field(default_factory=list)
    completions: list[list[list[int]]] = field(default_factory=list)
    logprobs: list[list[list[float]]] = field(default_factory=list)
    rewards: list[list[float]] = field(default_factory=list)
    correct: list[list[float]] = field(default_factory=list)
    source: list[str] = field(default_factory=list)
    """The name of the policy that sampled each group."""
    temperature: float | None = None
    """The sampling temperature of every logged log-prob (None: unknown, a buffer saved before this field)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self, groups=None) -> None:
        """Raise ValueError unless every group has one prompt, one source, and, per completion, its log-probs (one
        per token), its reward and its correctness: a group with more rewards than completions would shift its
        baseline without a word. Called when a buffer is made, loaded, saved and trained on; ``groups`` (indices)
        limits the per-group part to those groups (a training step checks the ones it drew)."""
        names = ("prompts", "completions", "logprobs", "rewards", "correct", "source")
        counts = {k: len(getattr(self, k)) for k in names}
        if len(set(counts.values())) > 1:
            raise ValueError(f"the buffer's lists have different lengths (one entry per group each): {counts}")
        for i in range(len(self)) if groups is None else groups:
            comps, logps, rewards, correct = self.completions[i], self.logprobs[i], self.rewards[i], self.correct[i]
            if not comps:
                raise ValueError(f"the buffer's group {i} has no completions: a group needs at least one (GRPO: two)")
            if not len(comps) == len(logps) == len(rewards) == len(correct):
                raise ValueError(
                    f"the buffer's group {i} has {len(comps)} completions but {len(logps)} lists of log-probs, "
                    f"{len(rewards)} rewards and {len(correct)} correctness values: one of each per completion"
                )
            for j, (tokens, lp) in enumerate(zip(comps, logps)):
                if len(tokens) != len(lp):
                    raise ValueError(
                        f"the buffer's group {i}, completion {j} has {len(tokens)} tokens but {len(lp)} log-probs"
                    )
                if not all(map(math.isfinite, lp)):  # a sampled token has a finite log-prob; inf or NaN is a bug
                    raise ValueError(f"the buffer's group {i}, completion {j} has a log-prob that is not finite: {lp}")
            if not all(map(math.isfinite, rewards)):  # it would make a step's gradient NaN whenever it is drawn
                raise ValueError(
                    f"the buffer's group {i} has a reward that is not finite: {rewards}; fix the reward (or drop the "
                    "group) before training on the buffer"
                )

    def __len__(self) -> int:
        return len(self.prompts)

    def fingerprint(self) -> str:
        """A 16-hex-digit hash of the buffer's contents: a checkpoint of :func:`train_offline` keeps it, and a
        resume from a different buffer is refused (its steps would draw other groups)."""
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        text = json.dumps(fields, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x))  # NumPy, torch
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __add__(self, other: RolloutBuffer) -> RolloutBuffer:
        if not len(self) or not len(other):  # an empty accumulator (sum(buffers, RolloutBuffer())) has no samples
            temps = (self.temperature if len(self) else other.temperature,) * 2
        else:
            temps = (self.temperature, other.temperature)
        if None not in temps and temps[0] != temps[1]:
            raise ValueError(
                f"cannot join buffers sampled at temperatures {temps[0]} and {temps[1]}: their log-probs are of "
                "different distributions, and training scores every group at one. Collect both at one temperature."
            )
        if temps.count(None) == 1:
            warn_at_caller(
                f"joining a buffer sampled at temperature {temps[0] if temps[0] is not None else temps[1]} with one "
                "of unknown temperature (saved before buffers recorded it): the joined buffer's temperature is "
                "unknown, so training cannot check that it scores at the temperature the groups were sampled at",
            )
        lists = {k: getattr(self, k) + getattr(other, k) for k in self.__dataclass_fields__ if k != "temperature"}
        return RolloutBuffer(**lists, temperature=None if None in temps else temps[0])

    def summary(self) -> pd.DataFrame:
        """One row per source policy: its groups, mean reward, share correct and completion length (no rows for
        an empty buffer)."""
        self.check()
        rows = [
            {
                "source": s,
                "reward": r,
                "correct": sum(c) / len(c),
                "tokens": sum(map(len, comps)) / len(comps),
            }
            for s, r, c, comps in zip(
                self.source, (sum(r) / len(r) for r in self.rewards), self.correct, self.completions
            )
        ]
        table = pd.DataFrame(rows, columns=["source", "reward", "correct", "tokens"]).groupby("source", sort=False)
        return table.agg(
            groups=("reward", "size"), reward=("reward", "mean"), correct=("correct", "mean"), tokens=("tokens", "mean")
        )

    def save(self, path: str | Path) -> Path:
        """Write the buffer to one file (``torch.save`` of plain lists); read it with :meth:`load`."""
        self.check()  # its lists are filled in place (collect_buffer appends), so check them before they are kept
        path = Path(path)
        clash = file_in_the_way(path.parent)
        if clash is not None:  # the buffer stays in memory: save it again to another path
            raise NotADirectoryError(f"cannot save the buffer to {str(path)!r}: {clash}. Pass a path in a folder.")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: getattr(self, k) for k in self.__dataclass_fields__}, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> RolloutBuffer:
        if not Path(path).exists():
            raise FileNotFoundError(f"no rollout buffer at {path}; write one with collect_buffer(...).save(path)")
        saved = torch.load(path, weights_only=True)
        unknown = sorted(set(saved) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"the rollout buffer at {path} has fields {unknown} that this version of edurl does not know (it "
                f"knows {sorted(cls.__dataclass_fields__)}): it was saved by a newer edurl; update edurl to read it"
            )
        return cls(**saved)


def collect_buffer(
    samplers: Mapping[str, SamplingClient],
    renderer: ChatMLRenderer,
    task,
    num_groups: int,
    group_size: int = 8,
    max_tokens: int = 16,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
    progress_bar: bool = True,
) -> RolloutBuffer:
    """``num_groups`` groups of ``group_size`` completions from each sampler, on training problems that differ
    between samplers (seeded by ``seed`` and the sampler's position), graded by the task's verifier."""
    if not samplers:
        raise ValueError("samplers is empty; pass e.g. {'sft': trainer.save_weights_and_get_sampling_client()}")
    buffer = RolloutBuffer(temperature=float(temperature))
    stop = renderer.get_stop_sequences()
    jobs = [(name, start) for name in samplers for start in range(0, num_groups, batch_size)]
    for name, start in progress(jobs, desc="rollout buffer", disable=not progress_bar):
        k = list(samplers).index(name)
        chunk_seed = problem_seed(seed, 1_000_000 * (k + 1) + start)
        problems = task.sample(min(batch_size, num_groups - start), split="train", seed=chunk_seed)
        prompts = [renderer.build_generation_prompt(p.messages()) for p in problems]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop, seed=chunk_seed)
        for problem, prompt, response in zip(
            problems, prompts, samplers[name].sample_batch(prompts, group_size, params)
        ):
            parsed = [renderer.parse_response(s.tokens, s.stop_reason) for s in response.sequences]
            grades = [grade(message["content"], problem.answer, complete=ok) for message, ok in parsed]
            buffer.prompts.append(list(prompt))
            buffer.completions.append([list(s.tokens) for s in response.sequences])
            buffer.logprobs.append([list(s.logprobs) for s in response.sequences])
            buffer.rewards.append([g.reward for g in grades])
            buffer.correct.append([float(g.correct) for g in grades])
            buffer.source.append(name)
    return buffer


def _check_advantage(advantage, config: GRPOConfig) -> None:
    if not (callable(advantage) or advantage in ADVANTAGES):
        raise ValueError(f"advantage must be one of {ADVANTAGES} or a function f(rewards, tau), got {advantage!r}")
    if not config.center_advantages and advantage != "mean":  # soft advantages carry their own baseline
        raise ValueError(
            "center_advantages=False (raw rewards as advantages) applies to advantage='mean' only; with "
            f"advantage={advantage!r} leave it at True"
        )


def _check_buffer(config: GRPOConfig, buffer: RolloutBuffer, groups) -> None:
    """Refuse to train on ``groups`` (indices into ``buffer``) what the loss would read wrong."""
    buffer.check(groups)
    if buffer.temperature is not None and buffer.temperature != config.temperature:
        raise ValueError(
            f"the buffer's log-probs were sampled at temperature {buffer.temperature}, but config.temperature is "
            f"{config.temperature}, which the trainer scores at: the ratio pi / pi_sampler would compare two "
            f"distributions. Set config.temperature={buffer.temperature}, or collect the buffer at "
            f"{config.temperature}."
        )
    sizes = {len(buffer.completions[i]) for i in groups}
    if sizes != {config.group_size}:
        raise ValueError(
            f"the buffer's groups have {sorted(sizes)} completions, config.group_size is {config.group_size}"
        )
    if config.aggregation == "seq_mean_token_sum_norm":
        longest = max(len(c) for i in groups for c in buffer.completions[i])
        if longest > config.max_tokens:
            raise ValueError(
                f"a logged completion has {longest} tokens, more than config.max_tokens={config.max_tokens}, "
                "which Dr. GRPO's aggregation divides by as the generation budget; set max_tokens to the "
                "buffer's budget (collect_buffer's max_tokens)"
            )


def _check_batch_fits(config: GRPOConfig, buffer: RolloutBuffer) -> None:
    if config.batch_size > len(buffer):
        raise ValueError(
            f"batch_size={config.batch_size} groups per step, but the buffer holds {len(buffer)}; collect more "
            "groups or lower batch_size"
        )


def draw_groups(buffer: RolloutBuffer, batch_size: int, seed: int, step: int) -> list[int]:
    """The indices of the ``batch_size`` buffer groups that step ``step`` trains on: a function of (seed, step),
    so a run repeats and resumes."""
    generator = torch.Generator().manual_seed(problem_seed(seed, step))
    return torch.randperm(len(buffer), generator=generator)[:batch_size].tolist()


def offline_step(
    config: GRPOConfig,
    trainer,
    buffer: RolloutBuffer,
    step: int,
    advantage: str | Callable = "mean",
    tau: float | None = None,
) -> dict[str, float]:
    """One offline step: draw ``config.batch_size`` groups (:func:`draw_groups`), compute their advantages, build
    one datum per completion with its *logged* log-probs as the sampler's, and take :func:`edurl.llm.grpo.update`
    with ``config.loss_fn``. Returns the metrics row, with ``buffer/reward`` and ``buffer/correct``: the drawn
    groups', which the policy being trained did not sample.

    ``advantage`` is ``"mean"`` (GRPO's, with ``config.advantage_scale``), ``"soft"``
    (:func:`edurl.llm.losses.soft_advantages` with ``tau``, by default ``config.dro_beta`` as in DRO's derivation),
    or a function ``f(rewards, tau) -> advantages`` (a learner's soft advantages). "mean" is the default because it
    learned more in Chapter 10's study: with a small tau the soft baseline sits near each group's best reward, so
    almost every completion is pushed down, on every one of its tokens."""
    _check_advantage(advantage, config)
    _check_batch_fits(config, buffer)  # draw_groups would draw fewer groups than batch_size, without a word
    drawn = draw_groups(buffer, config.batch_size, config.seed, step)
    _check_buffer(config, buffer, drawn)
    rewards = torch.tensor([buffer.rewards[i] for i in drawn])  # (P, G)
    if advantage == "mean":  # as the online step: centred unless config.center_advantages is False
        adv = L.group_advantages(rewards, config.advantage_scale) if config.center_advantages else rewards.clone()
    else:
        soft = L.soft_advantages if advantage == "soft" else advantage
        adv = soft(rewards, config.dro_beta if tau is None else tau)
    keep = ~L.zero_variance_groups(rewards) if config.drop_uniform_groups else [True] * len(drawn)
    datums = [
        build_datum(buffer.prompts[i], tokens, logprobs, float(adv[n, j]))
        for n, i in enumerate(drawn)
        if keep[n]
        for j, (tokens, logprobs) in enumerate(zip(buffer.completions[i], buffer.logprobs[i]))
    ]
    row = {
        "buffer/reward": float(rewards.mean()),
        "buffer/correct": sum(sum(buffer.correct[i]) for i in drawn) / rewards.numel(),
        "buffer/advantage": float(adv.mean()),
    }
    return update(config, trainer, Rollout(step, datums, row))


def train_offline(
    config: GRPOConfig,
    buffer: RolloutBuffer,
    advantage: str | Callable = "mean",
    tau: float | None = None,
    step_fn=None,
) -> GRPOResult:
    """Train from ``buffer`` alone, starting from the config's SFT warm start, one :func:`offline_step` per step
    (``advantage`` and ``tau`` are its). Held-out evaluation, logging and checkpoints are GRPO's loop's.

    ``step_fn(config, trainer, buffer, step) -> dict`` replaces :func:`offline_step` (Chapter 10's exercise 10.3
    passes the learner's); it returns the step's metrics row and takes its one optimizer step itself.

    Of the config's advantage fields, ``advantage_scale``, ``center_advantages`` (with ``advantage="mean"``) and
    ``drop_uniform_groups`` act as in the online step. Checkpoints keep the buffer's :meth:`RolloutBuffer.fingerprint`,
    and a resume with another buffer is refused. One process only: under torchrun it is refused."""
    _check_advantage(advantage, config)
    _check_batch_fits(config, buffer)
    _check_buffer(config, buffer, range(len(buffer)))
    fingerprint = buffer.fingerprint()
    if step_fn is not None and not callable(step_fn):
        raise TypeError(f"step_fn must be a function step_fn(config, trainer, buffer, step) -> dict, got {step_fn!r}")

    def loop_step(trainer, renderer, task, step):
        if step_fn is None:
            return offline_step(config, trainer, buffer, step, advantage, tau)
        row = step_fn(config, trainer, buffer, step)
        if not isinstance(row, dict):
            raise TypeError(f"step_fn returned {type(row).__name__}; it must return the step's metrics as a dict")
        return dict(row)

    def on_resume(trainer, checkpoint, extra):
        saved = extra.get("buffer")  # None: a checkpoint saved before it was kept
        if saved is not None and saved != fingerprint:
            raise ValueError(
                f"the checkpoint in {checkpoint} was trained on another buffer (fingerprint {saved}, this one's is "
                f"{fingerprint}): the resumed steps would draw other groups than the run's. Resume with the buffer "
                "the run started with, or start a fresh run (resume=False, overwrite=True)."
            )

    return run_training_loop(
        config,
        loop_step,
        f"offline {config.loss_fn}",
        postfix="buffer/correct",
        on_resume=on_resume,
        extra_to_save=lambda next_step: {"buffer": fingerprint},
    )
