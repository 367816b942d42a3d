"""Supervised fine-tuning: the warm start for RL (Chapter 6).

RL needs a policy that sometimes succeeds: with a reward of 0 on every sample,
every group-centred advantage is 0 and nothing is learned. So the course first
trains its tiny LM on demonstrations (``\\boxed{answer}`` after each question)
for a short, fixed budget. That leaves it well formatted but only partly
correct, which is the head-room Chapter 7's GRPO run climbs.

The loss is next-token cross-entropy on the assistant reply only (weight 0 on
prompt tokens). Checkpoints are cached in ``$EDURL_CACHE/sft/<key>`` (default
``~/.cache/edurl``), keyed by a hash of the config, so a notebook rerun or
Chapter 7 loads the model in a second instead of retraining it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from edurl._checks import check_count, check_fields
from edurl.llm.clients import AdamParams
from edurl.llm.datum import build_supervised_datum
from edurl.llm.evaluation import evaluate
from edurl.llm.model import TinyLMConfig, build_tiny_lm
from edurl.llm.padding import pad
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.tasks import TaskConfig
from edurl.llm.tokenizer import build_char_tokenizer
from edurl.utils import cpu_threads, file_in_the_way, torch_threads, warn_at_caller
from edurl.utils import device as pick_device
from edurl.utils import progress as progress_bar

if TYPE_CHECKING:
    from edurl.llm.grpo import GRPOConfig
    from edurl.llm.loop import GRPOResult

CACHE_VERSION = 1  # bump when training code changes what a config produces


@dataclass
class SFTConfig(TaskConfig):
    """Supervised warm start of the tiny LM on arithmetic demonstrations (the task's fields come from
    :class:`edurl.llm.tasks.TaskConfig`)."""

    model: TinyLMConfig = field(default_factory=TinyLMConfig)
    """Sizes of the tiny LM."""
    max_steps: int = 1000
    """Optimizer steps that the learning-rate schedule spans (and, with no target, the steps trained)."""
    target_pass_at_1: float | None = 0.3
    """Stop as soon as greedy pass@1 on the validation split reaches this: a warm start for RL
    should be partly skilled. None trains for ``max_steps``."""
    extra_steps: int = 1000
    """With a target: the steps past ``max_steps`` that training may take to reach it, at ``extra_learning_rate``.
    A seed whose loss is still in its plateau when the schedule ends needs them (seeds 7 and 9 did)."""
    extra_learning_rate: float = 1.5e-3
    """The constant learning rate of those extra steps: half the default peak (a fixed value: it does not follow
    ``learning_rate``, so set both when you change the peak), a warm restart after the schedule's decay
    to 10 %. At 10 %, seeds 7 and 9 reached the target but gave fragile warm starts, which GRPO's first steps
    knocked down and which gained under 5 points in 300 steps (Chapter 7)."""
    check_every: int = 10
    """Steps between validation checks of ``target_pass_at_1``."""
    num_valid: int = 200
    """Validation problems for that check."""
    batch_size: int = 64
    """Problems per step (fresh ones each step)."""
    learning_rate: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay)."""
    warmup_steps: int = 30
    """Steps of linear learning-rate warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    seed: int = 0
    """Seeds the initial weights and the training problems."""
    num_threads: int = 2
    """torch CPU threads while training."""
    device: str | None = None
    """Where to train: "cpu", "cuda", ...; None picks with edurl.device(). Part of the cache key on a GPU
    (its float results differ from the CPU's), so a GPU and a CPU never share a checkpoint."""

    def key(self) -> str:
        """A short hash of everything that determines the trained weights."""
        fields = asdict(self)
        fields["lr"] = fields.pop("learning_rate")  # the field's old name: keys (and cached checkpoints) unchanged
        if fields["target_pass_at_1"] is None or not fields["extra_steps"]:  # then training is that of before the
            del fields["extra_steps"], fields["extra_learning_rate"]  # fields existed, and so are the keys
        if not fields["styled"]:  # plain tasks keep the keys (and cached checkpoints) of before the field existed
            del fields["styled"]
        return checkpoint_key({"v": CACHE_VERSION, **fields})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            positive_int=("max_steps", "check_every", "num_valid", "batch_size", "num_threads"),
            nonneg_int=("warmup_steps", "seed", "extra_steps"),
            nonneg=("learning_rate", "weight_decay", "extra_learning_rate"),
            unit=("target_pass_at_1",),
            optional=("target_pass_at_1",),
        )
        check_warmup(self)


def check_warmup(config) -> None:
    """Warn when a warm start's linear warm-up is longer than its schedule (``max_steps``): its learning rate would
    climb for the whole run and stop short of ``learning_rate``, a run shortened without its warm-up."""
    if config.warmup_steps > config.max_steps:
        reached = warmup_cosine(config.learning_rate, config.max_steps - 1, config.max_steps, config.warmup_steps)
        warn_at_caller(
            f"{type(config).__name__}: warmup_steps={config.warmup_steps} is more than max_steps={config.max_steps}, "
            f"so the learning rate rises through the whole run and ends at {reached:.3g}, short of its peak "
            f"learning_rate={config.learning_rate:g}. Set warmup_steps to at most max_steps (about a tenth of it is "
            "usual), e.g. warmup_steps=max(1, max_steps // 10)."
        )


def checkpoint_key(fields: dict) -> str:
    """A 16-hex-digit hash of a warm start's config fields, as they determine its weights: ``num_threads`` as the
    threads that actually train (see :func:`edurl.utils.cpu_threads`), and ``device`` as its kind, left out on the
    CPU so that CPU keys stay those of the checkpoints cached before the field existed."""
    fields = dict(fields)
    fields["num_threads"] = cpu_threads(fields["num_threads"])
    kind = pick_device(fields.pop("device")).type
    if kind != "cpu":
        fields["device"] = kind
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """Where SFT checkpoints live: ``$EDURL_CACHE`` or ``~/.cache/edurl``."""
    return Path(os.environ.get("EDURL_CACHE") or Path.home() / ".cache" / "edurl")


def demonstration_example(renderer: ChatMLRenderer, problem) -> tuple[list[int], list[float]]:
    """Tokens and per-token weights of ``problem``'s question followed by its worked answer (weight 1 on the reply)."""
    return renderer.build_supervised_example(
        [*problem.messages(), {"role": "assistant", "content": problem.demonstration()}]
    )


def _batch(renderer: ChatMLRenderer, problems, pad_id: int):
    """Right-padded (B, T) tokens, attention mask and loss weights for a list of problems."""
    examples = [demonstration_example(renderer, p) for p in problems]
    tokens, mask = pad([t for t, _ in examples], pad_id)
    weights, _ = pad([w for _, w in examples], 0, dtype=torch.float32, length=tokens.shape[1])
    return tokens, mask, weights


def sft_loss(model, tokens: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over weighted target tokens: predict ``tokens[:, 1:]`` from ``tokens[:, :-1]``."""
    logits = model(input_ids=tokens[:, :-1], attention_mask=mask[:, :-1]).logits  # (B, T-1, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # 16-bit raised; a float64 model kept
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    w = weights[:, 1:].flatten()  # the weight of a target token
    return (nll * w).sum() / w.sum()


def warmup_cosine(peak: float, step: int, total: int, warmup: int) -> float:
    """The warm starts' learning rate at ``step``: linear warm-up over ``warmup`` steps, then cosine decay to 10 %
    at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_sft(config: SFTConfig | None = None, progress: bool = True, num_eval: int = 200):
    """Train the tiny LM from scratch. Returns ``(model, tokenizer, history)``.

    ``history`` is a list of dicts, one per step, with ``step``, ``loss``, ``lr`` and
    ``time``; every ``check_every`` steps also ``valid_pass_at_1``; the last row also
    ``pass_at_1`` and ``format`` on ``num_eval`` test problems, and with a target ``target_met``.
    A target still unmet after ``max_steps + extra_steps`` steps gives a warning, not an error: the model is kept.
    """
    config = config or SFTConfig()
    check_count(num_eval, "num_eval", "test problems")  # 0 once trained to the end, then raised and lost the model
    tokenizer = build_char_tokenizer()
    renderer = ChatMLRenderer(tokenizer)
    task = config.task()
    dev = pick_device(config.device)
    model = build_tiny_lm(tokenizer, config.model, seed=config.seed).to(dev)
    valid = task.sample(config.num_valid, split="valid", seed=config.seed)
    test = task.sample(num_eval, split="test", seed=config.seed)
    valid_budget = reply_budget(renderer, valid)
    opt = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay, betas=(0.9, 0.98)
    )

    def lr_at(step: int) -> float:
        if step >= config.max_steps:  # an extra step, towards an unmet target
            return config.extra_learning_rate
        return warmup_cosine(config.learning_rate, step, config.max_steps, config.warmup_steps)

    history: list[dict] = []
    start = time.perf_counter()
    steps = config.max_steps + (config.extra_steps if config.target_pass_at_1 is not None else 0)
    met = False
    with torch_threads(config.num_threads):
        problems = task.sample(steps * config.batch_size, split="train", seed=config.seed)  # a prefix of a longer run's
        bar = progress_bar(range(steps), desc="SFT", disable=not progress)
        for step in bar:
            model.train()
            batch = _batch(
                renderer, problems[step * config.batch_size : (step + 1) * config.batch_size], tokenizer.pad_token_id
            )
            tokens, mask, weights = (x.to(dev) for x in batch)
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            loss = sft_loss(model, tokens, mask, weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            row = {"step": step, "loss": loss.item(), "lr": lr_at(step), "time": time.perf_counter() - start}
            history.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", refresh=False)
            if config.target_pass_at_1 is not None and (step + 1) % config.check_every == 0:
                row["valid_pass_at_1"] = evaluate(model, renderer, valid, max_tokens=valid_budget).pass_at_1
                bar.set_postfix(loss=f"{row['loss']:.3f}", valid_pass=f"{row['valid_pass_at_1']:.2f}", refresh=False)
                if row["valid_pass_at_1"] >= config.target_pass_at_1:
                    met = True
                    break
        bar.close()
        result = evaluate(model, renderer, test, max_tokens=reply_budget(renderer, test))
    history[-1].update(pass_at_1=result.pass_at_1, format=result.format)
    if config.target_pass_at_1 is not None:
        history[-1]["target_met"] = met
        if not met:
            checks = [r["valid_pass_at_1"] for r in history if "valid_pass_at_1" in r]
            best = (
                f"best {max(checks):.3f}" if checks else f"no check: fewer steps than check_every={config.check_every}"
            )
            warn_at_caller(
                f"SFT (seed {config.seed}) did not reach target_pass_at_1={config.target_pass_at_1} on the validation "
                f"split in {steps} steps ({best}); the model is returned as it is. Raise extra_steps or "
                "learning_rate, or try another seed.",
            )
    model.eval()
    return model, tokenizer, history


def reply_budget(renderer: ChatMLRenderer, problems, floor: int = 16) -> int:
    """``max_tokens`` for grading ``problems``' replies: room for the longest reference reply and its end of turn,
    and at least ``floor`` (the course's budget, which 2-digit sums fit; a 9-digit sum's reply needs 19 tokens, and a
    styled one with an opening and fillers up to 38, so a fixed 16 graded correct replies as cut off and wrong)."""
    return max([floor, *reply_lengths(renderer, problems)])


def reply_lengths(renderer: ChatMLRenderer, problems) -> list[int]:
    """The tokens of each problem's reference reply, its end of turn included: what a reply needs of ``max_tokens``."""
    stop = len(renderer.get_stop_sequences())
    return [len(renderer._encode(p.demonstration())) + stop for p in problems]


def load_or_train_sft(config: SFTConfig | None = None, progress: bool = True, retrain: bool = False):
    """The SFT checkpoint for ``config``: loaded from the cache, or trained and cached.

    Returns ``(model, tokenizer, history, path)``. Writes go to a temporary folder
    first and are renamed into place, so two processes never see half a checkpoint.
    """
    config = config or SFTConfig()
    return cached_checkpoint(
        config.key(), config, lambda: train_sft(config, progress=progress), config.device, retrain=retrain
    )


def cached_checkpoint(key: str, config, train, device: str | None = None, retrain: bool = False):
    """``cache_dir()/sft/key``: loaded when it is there (unless ``retrain``), else ``train() -> (model, tokenizer,
    history)`` and saved with ``config`` beside it. Returns ``(model, tokenizer, history, path)``."""
    path = cache_dir() / "sft" / key
    if path.is_dir() and not retrain:
        model = AutoModelForCausalLM.from_pretrained(path).to(pick_device(device)).eval()
        with torch.no_grad():  # off the file: weights read from a memory map keep it open, and Windows then
            for tensor in [*model.parameters(), *model.buffers()]:  # refuses to replace the folder (retrain=True)
                tensor.data = tensor.data.clone()
        tokenizer = AutoTokenizer.from_pretrained(path)
        probe = "<|im_start|>user\n12 + 34=?<|im_end|>\n"
        if tokenizer.encode(probe) != build_char_tokenizer().encode(probe):
            raise RuntimeError(
                f"AutoTokenizer loaded {path} as {type(tokenizer).__name__}, which tokenizes differently "
                "from the course tokenizer (see edurl/llm/model.py on arch='qwen2'). Use arch='llama'."
            )
        history = json.loads((path / "history.json").read_text(encoding="utf-8"))
        return model, tokenizer, history, path
    clash = file_in_the_way(path.parent)  # checked before train(): mkdir below failed only after minutes of it
    if clash is not None:
        raise NotADirectoryError(
            f"cannot cache the checkpoint at {str(path)!r}: {clash}. Point $EDURL_CACHE at a folder (it is made if "
            "missing); nothing was trained."
        )
    model, tokenizer, history = train()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "history.json").write_text(json.dumps(history))
    (tmp / "config.json.edurl").write_text(json.dumps(asdict(config), indent=1))
    earlier = None
    if retrain and path.is_dir():
        # moved aside whole, then deleted: deleting in place could stop halfway (a file that Windows will not
        # delete while a process has it open) and leave a checkpoint that no longer loads
        earlier = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-earlier-")) / path.name
        try:
            os.replace(path, earlier)
        except OSError as error:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(earlier.parent, ignore_errors=True)
            raise RuntimeError(
                f"retrain=True could not move the cached checkpoint {path} aside to replace it ({error}); it is "
                "unchanged. A process that has it open (another notebook's kernel, on Windows) holds it: close "
                "that process, or restart this kernel, and retrain again."
            ) from error
    try:
        os.replace(tmp, path)
    except OSError as error:  # another process cached the same config first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
        if not path.exists():  # no: the move itself failed. The earlier checkpoint, if any, goes back
            if earlier is not None:
                os.replace(earlier, path)
                shutil.rmtree(earlier.parent, ignore_errors=True)
            raise RuntimeError(
                f"could not move the trained checkpoint into {path} ({error})"
                + ("; the earlier checkpoint is back in its place" if earlier is not None else "")
            ) from error
    if earlier is not None:
        shutil.rmtree(earlier.parent, ignore_errors=True)
    return model, tokenizer, history, path


def continued_sft(config: GRPOConfig | None = None) -> GRPOResult:
    """The step-matched baseline of :func:`edurl.llm.grpo.train_grpo` ``(config)``: the same start trained on the right answers.

    Everything GRPO's training half uses is kept: the trainer built from ``config``, Adam at
    ``learning_rate``, ``max_steps`` batches of ``batch_size * group_size`` sequences, each split into
    ``num_substeps`` optimizer steps, the ``aggregation`` and the held-out evaluation. Only the
    sequences differ: fresh training problems with their worked answers (``loss_fn="cross_entropy"``)
    instead of graded samples, and there is no sampling to pay for. This needs the answers; GRPO
    needs only the verifier. Writes ``log_dir/metrics.jsonl`` (``optim/loss``, ``optim/entropy``,
    ``test/pass_at_1``, ``time/train``); ``result.trainer`` holds the model.
    """
    from edurl.llm.grpo import GRPOConfig  # here, not at the top: grpo and loop import this module
    from edurl.llm.loop import problem_seed, run_training_loop, substeps

    config = config or GRPOConfig()
    if config.resume:
        raise ValueError("continued_sft starts fresh; set resume=False")
    n = config.batch_size * config.group_size

    def step_fn(trainer, renderer, task, step):
        t0 = time.perf_counter()
        problems = task.sample(n, split="train", seed=problem_seed(config.seed, step))
        datums = [build_supervised_datum(*demonstration_example(renderer, p)) for p in problems]
        rows = []
        for chunk in substeps(datums, config.num_substeps):
            out = trainer.forward_backward(
                chunk, "cross_entropy", aggregation=config.aggregation, max_tokens=config.max_tokens
            ).result()
            opt = trainer.optim_step(AdamParams(learning_rate=config.learning_rate)).result()
            rows.append({"optim/loss": out.loss, "optim/entropy": out.metrics["optim/entropy"], **opt})
        row = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
        return {**row, "time/train": time.perf_counter() - t0}

    return run_training_loop(
        replace(config, kl_coef=0.0, log_kl_ref=False), step_fn, "continued SFT", postfix="optim/loss"
    )
