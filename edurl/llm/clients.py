"""Local training and sampling clients with Tinker-style calls (Chapter 7).

The RL loop of the reference documents is written against a remote service::

    service = ServiceClient()
    trainer = service.create_lora_training_client(base_model, rank=16)   # or create_training_client: full weights
    sampler = trainer.save_weights_and_get_sampling_client("step_0")
    result = sampler.sample(prompt, num_samples=8, sampling_params=params).result()
    fwd = trainer.forward_backward(datums, "ppo").result()              # gradients accumulate ...
    trainer.optim_step(AdamParams(learning_rate=1e-4)).result()         # ... until the optimizer step

These classes run the same calls in this process, on a CPU or one GPU, so a cookbook-style loop runs
unchanged and every line of it can be read. Calls run eagerly and return a :class:`Future` that is
already resolved; ``*_async`` variants return the same future from a coroutine.

What each call does here:

* ``forward_backward`` pads the datums into one batch, computes ``log pi(target_tokens)`` at the
  sampling ``temperature`` (the sampler reports log-probs at its temperature, so scoring at the same one
  makes the ratio exactly 1 on-policy; :mod:`edurl.llm.shared_prefix` runs a prompt shared by a group once),
  then hands them to :func:`edurl.llm.losses.rl_objective`, which holds the whole objective (per-token loss,
  aggregation, KL term, diagnostics), and calls ``backward``. It returns the per-token log-probs and the
  diagnostics. Dropout is switched off for good when a client is made (as TRL's ``disable_dropout`` does):
  with it on, the same weights would score the same tokens differently and the ratio would not be 1 on-policy.
* ``optim_step`` runs one Adam step on the accumulated gradients and zeroes them. Weights stored in
  bf16 or fp16 get fp32 master copies that the optimizer updates (small steps would round away in bf16).
* ``save_weights_and_get_sampling_client`` snapshots the current weights into a
  :class:`SamplingClient`: later training does not change what that sampler draws from, which is what
  makes a stale sampler a real (and measurable) mistake.
* ``save_state`` / ``load_state`` write and read the weights with the optimizer, for resuming.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from edurl.llm import losses as L
from edurl.llm.datum import Datum, ModelInput
from edurl.llm.padding import pad
from edurl.llm.policy import LoraSettings, load_policy, refuse_prompt_learning, wrap_lora
from edurl.llm.sampling import PrefixCache, SamplingParams, embedding_rows, sample
from edurl.llm.shared_prefix import token_logprobs
from edurl.utils import file_in_the_way

T = TypeVar("T")

#: loss_fn names accepted by ``TrainingClient.forward_backward``: the RL losses and SFT's cross-entropy
LOSS_FN_NAMES = ("cross_entropy", *L.LOSS_FNS)


class Future(Generic[T]):
    """The result of a client call. Local calls run eagerly, so ``result()`` returns at once."""

    def __init__(self, value: T):
        self._value = value

    def result(self, timeout: float | None = None) -> T:
        return self._value

    def __repr__(self) -> str:
        return f"Future({type(self._value).__name__})"


@dataclass
class AdamParams:
    """One optimizer step's settings: AdamW with decoupled weight decay.

    The field names, and the defaults of ``learning_rate``, ``beta1``, ``beta2`` and ``weight_decay``, are
    Tinker's. Two defaults differ on purpose:

    - ``eps`` is 1e-8 (PyTorch's default) where Tinker's is 1e-12. Every run in the course was measured with
      1e-8; for weights with near-zero second moments it also caps the step size sooner.
    - ``grad_clip_norm`` is 1.0 where Tinker's default, 0.0, means no clipping. The course's GRPO runs clip,
      which keeps a tiny model's first steps from a sharp batch stable. Pass ``grad_clip_norm=0.0`` (or None)
      to match Tinker.
    """

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float | None = 1.0
    """Clip the global gradient norm to this before stepping; 0.0 or None skips clipping (Tinker: 0.0)."""

    def __post_init__(self) -> None:
        if not (self.learning_rate >= 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be a finite number >= 0, got {self.learning_rate!r}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        # torch checks eps and weight_decay only when AdamW is built, at the first step: after it, a negative
        # value ran (eps < 0 can divide by ~0, weight_decay < 0 grows every weight)
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be a finite number > 0 (e.g. 1e-8), got {self.eps!r}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay must be a finite number >= 0 (0.0: no decay), got {self.weight_decay!r}")
        if self.grad_clip_norm is not None and not self.grad_clip_norm >= 0:
            raise ValueError(f"grad_clip_norm must be >= 0 (0.0 or None: no clipping), got {self.grad_clip_norm!r}")


@dataclass
class SampledSequence:
    """One completion: its tokens and, for each, the sampling log-prob."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


@dataclass
class SampleResponse:
    sequences: list[SampledSequence]


@dataclass
class ForwardBackwardOutput:
    """What ``forward_backward`` returns."""

    loss: float
    """The aggregated loss that was back-propagated (KL penalty included)."""
    loss_fn_outputs: list[dict[str, torch.Tensor]]
    """One dict per datum: ``logprobs``, the training log-probs of its target tokens, shape (n,)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``optim/entropy``, ``optim/kl_sample_train_v1``/``v2``, ``optim/clip_fraction``, ``optim/kl_ref``."""
    metric_tokens: int | None = None
    """How many action tokens those metrics average over: every datum's, or only the scored datums' when
    ``TrainingClient.score_zero_advantage`` is False (data parallelism weights each rank's metrics by it)."""
    all_zero_advantage: bool = False
    """True when zero-advantage datums were to go unscored but every datum had advantage 0, so all of them were
    scored (there was nothing else to run) and the metrics cover them all. Under data parallelism such a rank's
    metrics get no weight when another rank scored datums, as one process on the whole batch would not score these."""


def _as_model_input(prompt) -> list[int]:
    if isinstance(prompt, ModelInput):
        return prompt.to_ints()
    if isinstance(prompt, torch.Tensor):
        return prompt.tolist()
    return list(prompt)


class SamplingClient:
    """Draws completions from a frozen snapshot of a policy's weights."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str = "sampler"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name

    def sample(
        self, prompt: ModelInput | Sequence[int], num_samples: int = 1, sampling_params: SamplingParams | None = None
    ) -> Future[SampleResponse]:
        """``num_samples`` completions of one prompt (the prompt is encoded once)."""
        return Future(self.sample_batch([prompt], num_samples, sampling_params)[0])

    def sample_batch(
        self,
        prompts: Sequence[ModelInput | Sequence[int]],
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        prefix_cache: PrefixCache | None = None,
        cache_keys: Sequence[Hashable] | None = None,
    ) -> list[SampleResponse]:
        """Many prompts in one batched call: what a GRPO step does with its P problems. Not in Tinker's API.
        ``prefix_cache`` and ``cache_keys`` let a multi-turn rollout skip the turns it ran before
        (:class:`edurl.llm.sampling.PrefixCache`)."""
        ids = [_as_model_input(p) for p in prompts]
        out = sample(
            self.model,
            ids,
            num_samples,
            sampling_params,
            pad_token_id=self.tokenizer.pad_token_id,
            prefix_cache=prefix_cache,
            cache_keys=cache_keys,
        )
        return [
            SampleResponse(
                [
                    SampledSequence(c.tokens, c.logprobs, c.stop_reason)
                    for c in out[i * num_samples : (i + 1) * num_samples]
                ]
            )
            for i in range(len(ids))
        ]

    async def sample_async(self, prompt, num_samples: int = 1, sampling_params: SamplingParams | None = None):
        return self.sample(prompt, num_samples, sampling_params)


class NoGradientError(RuntimeError):
    """optim_step with no gradient to apply (no forward_backward since the last step): nothing was changed."""


# loss_fn_config values to suggest when a loss's required argument is missing
_CONFIG_EXAMPLES = {"beta": 0.05}


def _check_loss(loss_fn: str, loss_fn_config: dict[str, Any] | None, aggregation: str, max_tokens) -> None:
    """What forward_backward refuses about the loss before it runs the model: an unknown loss or aggregation, a
    loss_fn_config key the loss does not take or an argument it needs and did not get (dro's beta), and Dr. GRPO's
    aggregation without its token budget."""
    if loss_fn not in LOSS_FN_NAMES:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; choose one of {list(LOSS_FN_NAMES)}")
    L.check_aggregation(aggregation, max_tokens)
    if loss_fn == "cross_entropy":
        if loss_fn_config:  # supervised_objective takes no argument that a config could set
            raise ValueError(
                f"loss_fn_config has {sorted(loss_fn_config)}, which 'cross_entropy' does not take: it has no "
                "config; pass loss_fn_config=None"
            )
        return
    # the per-token loss's arguments after (train_logprobs, sampling_logprobs, advantages)
    params = list(inspect.signature(L.get_loss_fn(loss_fn)).parameters.values())[3:]
    takes = [q.name for q in params]
    given = dict(loss_fn_config or {})
    unknown = set(given) - set(takes)
    if unknown:
        raise ValueError(f"loss_fn_config has {sorted(unknown)}, which {loss_fn!r} does not take; it takes {takes}")
    missing = [q.name for q in params if q.default is inspect.Parameter.empty and q.name not in given]
    if missing:
        example = {name: _CONFIG_EXAMPLES.get(name, "...") for name in missing}
        raise ValueError(
            f"loss_fn {loss_fn!r} needs {missing} in loss_fn_config, which has no default; pass e.g. "
            f"loss_fn_config={example}"
        )


def _check_datums(datums: Sequence[Datum], required: Sequence[str]) -> None:
    if not datums:
        raise ValueError("forward_backward needs at least one Datum")
    for i, d in enumerate(datums):
        if not isinstance(d, Datum):
            raise TypeError(
                f"datums[{i}] is a {type(d).__name__}; build it with Datum(model_input=..., loss_fn_inputs=...)"
            )
        missing = [k for k in required if k not in d.loss_fn_inputs]
        if missing:
            raise ValueError(f"datums[{i}].loss_fn_inputs lacks {missing}; this loss needs {list(required)}")
        _check_same_fields(datums[0], d, i)
        n = d.model_input.length
        for key, value in d.loss_fn_inputs.items():
            if value.shape != (n,):
                raise ValueError(
                    f"datums[{i}].loss_fn_inputs[{key!r}] has shape {tuple(value.shape)} but model_input "
                    f"has {n} tokens; every field needs shape ({n},)"
                )


def _check_same_fields(first: Datum, d: Datum, i: int) -> None:
    """A batch pads each ``loss_fn_inputs`` field into one (B, T) tensor, so every datum needs the fields of
    ``datums[0]``, no more and no fewer."""
    extra = [k for k in d.loss_fn_inputs if k not in first.loss_fn_inputs]
    lacking = [k for k in first.loss_fn_inputs if k not in d.loss_fn_inputs]
    if extra or lacking:
        what = f"has {extra!r}, which datums[0] lacks" if extra else f"lacks {lacking!r}, which datums[0] has"
        raise ValueError(
            f"datums[{i}].loss_fn_inputs {what}; give every datum in a batch the same fields (add the field to "
            "every datum, or drop it from all)"
        )


def _prompt_split(fields: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Where each row's prompt ends, for scoring shared prompts once (:func:`token_logprobs` splits each row
    at its first 1 here; the log-probs it returns are the same wherever the split falls).

    edurl's RL datums mask the prompt, so the mask alone says it (and is used as it is). A Tinker datum has no mask: its loss covers
    every position, the prompt's with advantage 0 and sampling log-prob 0. There the sampled tokens start at
    the first position with a non-zero sampling log-prob or advantage, and splitting there lets a group's
    shared prompt run once instead of once per row.
    """
    if "logprobs" not in fields or "advantages" not in fields:
        return mask
    sampled = ((fields["logprobs"] != 0) | (fields["advantages"] != 0)).to(mask.dtype)
    covers_start = mask[:, :1].bool()  # a loss from position 0 on: no prompt was masked (a Tinker datum)
    return torch.where(covers_start, mask * sampled, mask)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability in ``model`` to 0, in place: ``nn.Dropout`` modules and the attention
    dropout of Hugging Face attention layers (their ``attention_dropout`` attribute). Returns ``model``."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    config = getattr(model, "config", None)
    if config is not None and isinstance(getattr(config, "attention_dropout", None), float):
        config.attention_dropout = 0.0
    return model


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of ``model`` in eval mode with no gradients: the reference policy of a KL penalty."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def _step_counts_on_cpu(optimizer_state: dict) -> dict:
    """``optimizer_state`` with Adam's per-parameter ``step`` counts on the CPU, where a fresh AdamW keeps them.
    ``torch.load(map_location=<the model's device>)`` moves them to the GPU, and ``load_state_dict`` leaves them
    there (it moves only the moments), so every later step would read each count back to the host: one
    synchronisation per parameter per step."""
    for per_param in optimizer_state.get("state", {}).values():
        step = per_param.get("step")
        if torch.is_tensor(step):
            per_param["step"] = step.cpu()
    return optimizer_state


class TrainingClient:
    """A policy being trained: forward/backward with a named loss, Adam steps, snapshots and checkpoints."""

    _backward = True  # forward() sets it False for its call: forward_backward's pass without the backward

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        reference: PreTrainedModel | None = None,
        log_dir: str | Path | None = None,
    ):
        refuse_prompt_learning(model, "TrainingClient")
        self.model = disable_dropout(model)
        self.tokenizer = tokenizer
        self._reference = (
            disable_dropout(reference) if reference is not None else None
        )  # None: LoRA's is the adapter off
        self.log_dir = Path(log_dir) if log_dir is not None else None
        clash = file_in_the_way(self.log_dir) if self.log_dir is not None else None
        if clash is not None:  # else save_state failed with a bare NotADirectoryError, after the training before it
            raise NotADirectoryError(f"log_dir {clash}; checkpoints go to <log_dir>/checkpoints, so pass a folder.")
        self.optimizer: torch.optim.Optimizer | None = None
        self._master: list[torch.nn.Parameter] | None = None  # fp32 copies of bf16/fp16 weights (optim_step)
        self.device = next(model.parameters()).device
        self.share_prompts = True
        """Run a prompt shared by several datums once (:mod:`edurl.llm.shared_prefix`); False: score whole rows."""
        self.skip_zero_advantage = True
        """In an RL ``forward_backward`` whose loss is 0 at advantage 0 (:data:`edurl.llm.losses.ZERO_AT_ZERO_ADVANTAGE`,
        no KL term in the loss), score the datums whose advantages are all 0 without building a graph: their
        gradient is 0, so the backward pass skips them. The loss, its denominator, the metrics and every
        datum's returned log-probs are those of the full batch. False: one pass with gradients over every datum."""
        self.score_zero_advantage = True
        """With ``skip_zero_advantage``: False does not score those datums at all, neither forward nor backward,
        as if they had been left out of the batch (as Tinker's ``rl_loop`` leaves out the groups whose rewards are
        all equal), except that their tokens still count in the loss's denominator. The loss and the gradient are
        unchanged; the metrics that read the training log-probs (``optim/kl_sample_train_*``,
        ``optim/clip_fraction``, ``optim/entropy``) cover the scored datums only, and the others' returned
        log-probs are NaN. Not with ``log_kl_ref``, and not when every datum's advantages are 0 (nothing would be
        scored): then they are scored as with True. ``GRPOConfig.score_zero_advantage`` sets it."""

    # ---------------------------------------------------------------- properties
    @property
    def is_lora(self) -> bool:
        return hasattr(self.model, "disable_adapter")

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # ---------------------------------------------------------------- forward / backward
    def _batch(self, datums: Sequence[Datum]):
        """Right-padded (B, T) input ids, attention mask and one (B, T) tensor per ``loss_fn_inputs`` field (every
        caller has run :func:`_check_datums`, so each datum has the first one's fields)."""
        keys = list(datums[0].loss_fn_inputs)
        ids, attn = pad([d.model_input.tokens for d in datums], self.tokenizer.pad_token_id or 0, device=self.device)
        fields = {
            key: pad(
                [d.loss_fn_inputs[key] for d in datums],
                0,
                dtype=torch.long if key == "target_tokens" else torch.float32,
                device=self.device,
            )[0]
            for key in keys
        }
        self._check_input_ids(ids, attn)
        self._check_targets(fields["target_tokens"], datums)
        return ids, attn, fields

    def _check_input_ids(self, ids: torch.Tensor, attn: torch.Tensor) -> None:
        """Refuse model_input ids outside the model's embedding (an IndexError deep in the model otherwise, and on
        CUDA a device-side assert). ``ids`` and ``attn`` are a right-padded (B, T) batch of the datums."""
        vocab = embedding_rows(self.model)
        if vocab is None:
            return
        bad = ((ids < 0) | (ids >= vocab)) & attn.bool()
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"datums[{i}].model_input token {j} is id {int(ids[i, j])}, outside the model's vocabulary of {vocab} "
                f"(0 to {vocab - 1}): was it encoded with another tokenizer than the model's?"
            )

    def _check_targets(self, targets: torch.Tensor, datums: Sequence[Datum], row: int = 0) -> None:
        """Refuse target tokens outside the vocabulary: a shared prompt reads its log-probs by a flat index, which
        would take another position's instead of failing. ``targets`` (B, T) are datums ``row`` on."""
        head = self.model.get_output_embeddings()
        vocab = head.weight.shape[0] if head is not None else self.model.config.vocab_size
        bad = (targets < 0) | (targets >= vocab)
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"datums[{i + row}].loss_fn_inputs['target_tokens'][{j}] is target token {int(targets[i, j])}, outside "
                f"the model's vocabulary of {vocab} (0 to {vocab - 1}); a target must be the id of the next token "
                "(a masked position too: its mask, not an ignore index such as -100, leaves it out of the loss)"
            )

    def _forward(self, reference: bool, **inputs):
        """The policy's forward pass, or the reference policy's (a frozen copy, or the LoRA adapter switched off)."""
        if not reference:
            return self.model(**inputs)
        if self._reference is not None:
            return self._reference(**inputs)
        if self.is_lora:
            with self.model.disable_adapter():
                return self.model(**inputs)
        raise ValueError("this training client has no reference model; create it with keep_reference=True")

    def _train_logprobs(
        self,
        ids,
        attn,
        targets,
        mask,
        with_entropy: bool = False,
        reference: bool = False,
        temperature: float = 1.0,
        prompt_grad: bool = True,
    ):
        """:func:`edurl.llm.shared_prefix.token_logprobs` with this client's model: (B, T) log-probs and entropy
        (or None). Gradient checkpointing (which drops the KV cache while training) scores every row whole. On the
        CPU, shared-prefix passes over short rows run with eager attention (``short_row_attention``), faster there,
        except in float64. ``prompt_grad=False``: the loss reads nothing before a row's first ``mask`` position."""
        checkpointing = self.model.training and any(
            getattr(m, "gradient_checkpointing", False) for m in self.model.modules()
        )
        return token_logprobs(
            lambda **inputs: self._forward(reference, **inputs),
            ids,
            attn,
            targets,
            mask,
            temperature=temperature,
            with_entropy=with_entropy,
            share_prompts=self.share_prompts and not checkpointing,
            pad_token_id=self.tokenizer.pad_token_id or 0,
            model_config=self.model.config,
            # not in float64: transformers' eager attention takes its softmax in float32, where a float64 mask's
            # lowest value becomes -inf, so a left-padded prompt's padding rows turn to NaN and spread to every row
            eager_short_rows=next(self.model.parameters()).dtype != torch.float64,
            # the policy's completions run packed (edurl.llm.packed); a reference that is the LoRA adapter
            # switched off needs the context that _forward enters, so it keeps the model's forward
            model=self.model if not reference else self._reference,
            prompt_grad=prompt_grad,
        )

    def _scored(
        self,
        ids,
        attn,
        targets,
        split,
        temperature: float,
        no_grad_rows: torch.Tensor | None,
        stand_in: torch.Tensor | None = None,
        prompt_grad: bool = True,
    ):
        """(B, T) training log-probs and entropy for ``forward_backward``: one pass with gradients, or, when some
        but not all rows are in ``no_grad_rows``, those rows in a pass without a graph and the rest with one,
        put back in their places (the values are the same up to rounding: the batches are only split). With
        ``stand_in`` ((B, T), e.g. the sampler's log-probs), the ``no_grad_rows`` are not scored: their log-probs
        are taken from it, with no graph, and their entropy is 0. ``prompt_grad`` goes to :meth:`_train_logprobs`."""
        score = functools.partial(
            self._train_logprobs, with_entropy=True, temperature=temperature, prompt_grad=prompt_grad
        )
        if no_grad_rows is None or not no_grad_rows.any() or no_grad_rows.all():
            return score(ids, attn, targets, split)
        if stand_in is not None:
            rows = (~no_grad_rows).nonzero().squeeze(1)
            lp, ent = score(ids[rows], attn[rows], targets[rows], split[rows])
            lp_all = stand_in.to(lp.dtype).index_copy(0, rows, lp)  # out of place: the scored rows keep their graph
            ent_all = torch.zeros_like(lp_all).index_copy(0, rows, ent.detach())
            return lp_all, ent_all
        parts = []
        for rows, grad in ((no_grad_rows.nonzero().squeeze(1), False), ((~no_grad_rows).nonzero().squeeze(1), True)):
            with torch.set_grad_enabled(grad):
                lp, ent = score(ids[rows], attn[rows], targets[rows], split[rows])
            parts.append((rows, lp, ent))
        B, T = ids.shape
        lp_all, ent_all = (torch.zeros(B, T, dtype=parts[1][1].dtype, device=ids.device) for _ in range(2))
        for rows, lp, ent in parts:
            lp_all = lp_all.index_copy(0, rows, lp)  # out of place: the gradient reaches the rows that have one
            ent_all = ent_all.index_copy(0, rows, ent.detach())  # entropy is a metric here
        return lp_all, ent_all

    def _mask(self, datums: Sequence[Datum], fields: dict[str, torch.Tensor], rl: bool) -> torch.Tensor:
        """The (B, T) positions the loss covers: RL datums say so in ``mask``; SFT datums by ``weights != 0``."""
        if not rl:
            return fields["mask"] if "mask" in fields else (fields["weights"] != 0).float()
        if "mask" not in fields:
            raise ValueError(
                "RL datums need a 'mask' field (1 where the target token is a sampled action, 0 on "
                "prompt and environment tokens); no mask is guessed from logprobs != 0, which would drop "
                "every token sampled with probability 1. Build datums with edurl.llm.build_datum, or add "
                "loss_fn_inputs['mask']."
            )
        return fields["mask"]

    def compute_logprobs(
        self, datums: Sequence[Datum], *, reference: bool = False, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """``log pi(target_tokens)`` of each datum, shape (n,), without gradients: the policy's, or the reference
        policy's with ``reference=True`` (a frozen copy, or the LoRA adapter switched off), at ``temperature``."""
        _check_datums(datums, ("target_tokens",))
        ids, attn, f = self._batch(datums)
        mask = f["mask"] if "mask" in f else attn.float()
        with torch.no_grad():
            lp, _ = self._train_logprobs(
                ids, attn, f["target_tokens"], _prompt_split(f, mask), reference=reference, temperature=temperature
            )
        return [lp[i, : d.model_input.length].cpu() for i, d in enumerate(datums)]

    def forward_backward(
        self,
        datums: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, Any] | None = None,
        *,
        aggregation: str = "sum",
        max_tokens: int | None = None,
        temperature: float = 1.0,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        log_kl_ref: bool = False,
    ) -> Future[ForwardBackwardOutput]:
        """Accumulate the gradient of :func:`edurl.llm.losses.rl_objective` over ``datums``: batch them, compute
        the training log-probs, call the objective, ``backward``.

        ``loss_fn`` is one of :data:`LOSS_FN_NAMES`; ``loss_fn_config`` holds its keyword arguments (e.g.
        ``{"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}`` for ``"ppo"``, ``{"beta": 0.1}`` for
        ``"dro"``); a key left out takes the loss's own default, and the clip range also sets which ratios count
        toward ``optim/clip_fraction``. RL losses read ``target_tokens``, ``logprobs`` (the sampler's),
        ``advantages`` and ``mask`` from every datum (:func:`edurl.llm.build_datum` writes all four);
        ``cross_entropy`` reads ``target_tokens`` and ``weights``. ``max_tokens`` is the generation budget that
        ``aggregation="seq_mean_token_sum_norm"`` (Dr. GRPO) divides by. ``temperature`` is the sampler's: the
        training log-probs are those of ``softmax(logits / temperature)``, so on-policy the ratio is exactly 1.
        ``kl_coef > 0`` adds a KL penalty to the reference policy *to the loss* (TRL's way; its gradient depends
        on ``kl_estimator``, see :func:`edurl.llm.losses.kl`); Tinker's way puts it into the advantages
        (:func:`edurl.llm.losses.kl_penalty_advantages`, ``GRPOConfig.kl_penalty="reward"``). ``log_kl_ref``
        adds ``optim/kl_ref`` (k3 against the reference policy) to the metrics at the cost of one more forward
        pass.
        """
        _check_loss(loss_fn, loss_fn_config, aggregation, max_tokens)
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (the sampler's; 0 = greedy scores at 1), got {temperature!r}")
        rl = loss_fn != "cross_entropy"
        if not rl and (kl_coef > 0 or log_kl_ref):
            raise ValueError(
                "kl_coef and log_kl_ref apply to the RL losses; cross_entropy (SFT) has no KL term. "
                "Pass kl_coef=0 and log_kl_ref=False."
            )
        _check_datums(datums, ("target_tokens", "logprobs", "advantages") if rl else ("target_tokens", "weights"))
        self.model.train()  # dropout was switched off when the client was made; train() only matters for e.g. checkpointing
        ids, attn, f = self._batch(datums)
        mask = self._mask(datums, f, rl)
        split = _prompt_split(f, mask)
        # whether the loss reads a position before a row's split (a Tinker datum's mask covers its prompt; edurl's
        # datums mask it): if not, none of those log-probs needs a gradient
        prompt_grad = bool((mask.bool() & (split.cumsum(1) == 0)).any())
        no_grad_rows, unscored, all_zero = None, None, False
        if rl and self.skip_zero_advantage and loss_fn in L.ZERO_AT_ZERO_ADVANTAGE and kl_coef == 0:
            no_grad_rows = ((f["advantages"] * mask) == 0).all(1)  # (B,) datums with no gradient to give
            if not self.score_zero_advantage and not log_kl_ref:
                all_zero = bool(no_grad_rows.all())  # then score them all: a loss needs something to run
                unscored = None if all_zero else no_grad_rows
        train_logprobs, entropy = self._scored(
            ids,
            attn,
            f["target_tokens"],
            split,
            temperature,
            no_grad_rows,
            # ratio 1 and advantage 0 on the unscored rows: their per-token loss is exactly 0 for these losses
            stand_in=f["logprobs"] if unscored is not None else None,
            prompt_grad=prompt_grad,
        )
        metric_mask = mask if unscored is None else mask * (~unscored).unsqueeze(1).to(mask.dtype)
        if rl:
            ref_logprobs = None
            if kl_coef > 0 or log_kl_ref:
                with torch.no_grad():
                    ref_logprobs, _ = self._train_logprobs(
                        ids, attn, f["target_tokens"], split, reference=True, temperature=temperature
                    )
            loss, metrics = L.rl_objective(
                train_logprobs,
                f["logprobs"],
                f["advantages"],
                mask,
                loss_fn=loss_fn,
                loss_fn_config=loss_fn_config,
                aggregation=aggregation,
                max_tokens=max_tokens,
                ref_logprobs=ref_logprobs,
                kl_coef=kl_coef,
                kl_estimator=kl_estimator,
                entropy=entropy,
                metric_mask=metric_mask,
            )
        else:
            loss, metrics = L.supervised_objective(
                train_logprobs, f["weights"], mask, aggregation=aggregation, max_tokens=max_tokens, entropy=entropy
            )
        if self._backward:  # False inside forward()
            loss.backward()
        returned = train_logprobs.detach()
        if unscored is not None:  # not computed: NaN, not the stand-in
            returned = returned.masked_fill(unscored.unsqueeze(1), float("nan"))
        outputs = [{"logprobs": returned[i, : d.model_input.length].cpu()} for i, d in enumerate(datums)]
        out = ForwardBackwardOutput(
            loss=float(loss.detach()),
            loss_fn_outputs=outputs,
            metrics=metrics,
            metric_tokens=int((metric_mask != 0).sum()),  # as rl_objective counts them: every nonzero weight
            all_zero_advantage=all_zero,
        )
        return Future(out)

    def forward(
        self, datums: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None = None, **kwargs
    ) -> Future[ForwardBackwardOutput]:
        """:meth:`forward_backward`'s loss, metrics and log-probs, without a backward pass: no gradient is
        accumulated (Tinker's ``forward``). Takes the same keyword arguments."""
        self._backward = False
        try:
            with torch.no_grad():
                return self.forward_backward(datums, loss_fn, loss_fn_config, **kwargs)
        finally:
            self._backward = True

    def check_inputs(self, datums: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None = None) -> None:
        """What :meth:`forward_backward` would refuse, checked without running the model: the loss's name, its
        config keys, each datum's fields and shapes, and every target token against the vocabulary (the local
        Tinker server calls it when a request arrives, so that a bad one is a 400, not a failed operation)."""
        _check_loss(loss_fn, loss_fn_config, "sum", None)
        rl = loss_fn != "cross_entropy"
        _check_datums(datums, ("target_tokens", "logprobs", "advantages") if rl else ("target_tokens", "weights"))
        self._check_input_ids(*pad([d.model_input.tokens for d in datums], 0))
        flat = torch.cat([d.loss_fn_inputs["target_tokens"].reshape(-1) for d in datums])
        try:
            self._check_targets(flat[None], datums)
        except ValueError:  # name the datum and position, as the padded batch's check does
            for i, d in enumerate(datums):
                self._check_targets(d.loss_fn_inputs["target_tokens"][None], [d], row=i)

    async def forward_backward_async(self, datums, loss_fn, loss_fn_config=None, **kwargs):
        return self.forward_backward(datums, loss_fn, loss_fn_config, **kwargs)

    # ---------------------------------------------------------------- optimizer
    def _stores_16_bit(self) -> bool:
        return any(q.dtype in (torch.bfloat16, torch.float16) for q in self.trainable_parameters())

    def _optimized_parameters(self) -> list[torch.nn.Parameter]:
        """What Adam updates: the trainable weights, or fp32 master copies of them when they are stored in a
        16-bit float. In bf16, a weight near 0.03 moves only by steps of about 1e-4, so Adam's steps of about
        ``learning_rate`` (e.g. 4e-5) would round to no change at all; the master copy accumulates them."""
        params = self.trainable_parameters()
        if self._master is None and self._stores_16_bit():
            self._master = [torch.nn.Parameter(q.detach().to(torch.float32).clone()) for q in params]
        return self._master if self._master is not None else params

    def optim_step(self, adam_params: AdamParams | None = None) -> Future[dict[str, float]]:
        """One Adam step on the gradients accumulated since the last step, then zero them."""
        p = adam_params or AdamParams()
        params = self.trainable_parameters()
        if not any(q.grad is not None for q in params):
            raise NoGradientError("optim_step found no gradients; call forward_backward first")
        targets = self._optimized_parameters()
        master = self._master is not None
        if master:  # fp32 master weights: hand them the gradients in fp32
            for m, q in zip(targets, params):
                m.grad = None if q.grad is None else q.grad.to(torch.float32)
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(
                targets, lr=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay
            )
        for group in self.optimizer.param_groups:
            group.update(lr=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay)
        grads = [q for q in targets if q.grad is not None]
        if p.grad_clip_norm:  # None or 0.0: no clipping (Tinker's 0.0)
            norm = torch.nn.utils.clip_grad_norm_(grads, p.grad_clip_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(q.grad) for q in grads]))
        if not torch.isfinite(norm):  # one Adam step on it would write nan into every weight it touches
            for q in {*targets, *params}:
                q.grad = None
            raise FloatingPointError(
                f"optim_step: the gradient norm is {float(norm)}, so the weights were left as they were and the "
                "gradients dropped. Usual causes: sampling log-probs that do not belong to these tokens or this "
                "model (the ratio exp(logp - sampling_logp) overflows), a learning rate large enough to have made "
                "the last step's loss overflow, or a reward or advantage that is inf or nan."
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if master:
            with torch.no_grad():
                for m, q in zip(targets, params):
                    q.copy_(m)  # rounds to the stored dtype; the master keeps what rounding dropped
                    q.grad = None
        return Future({"optim/grad_norm": float(norm), "optim/lr": p.learning_rate})

    async def optim_step_async(self, adam_params: AdamParams | None = None):
        return self.optim_step(adam_params)

    # ---------------------------------------------------------------- sampling and checkpoints
    def save_weights_and_get_sampling_client(self, name: str = "sampler") -> SamplingClient:
        """A sampler over a frozen copy of the current weights. Weights that are not trained (a LoRA adapter's frozen
        base) are shared with the snapshot, not copied: they cannot change, and a real model's base is most of its
        memory."""
        # new Parameter objects over the same storage: a .to() or dtype cast of the snapshot replaces its own
        # parameters' data, and must not move the trainer's (ProcessSampler moves its first snapshot to the CPU)
        frozen = {
            id(q): torch.nn.Parameter(q.detach(), requires_grad=False)
            for q in self.model.parameters()
            if not q.requires_grad
        }
        snapshot = copy.deepcopy(self.model, memo=frozen).eval()
        for q in snapshot.parameters():
            q.requires_grad_(False)
        return SamplingClient(snapshot, self.tokenizer, name)

    def _state_path(self, name: str) -> Path:
        base = self.log_dir if self.log_dir is not None else Path("checkpoints")
        return base / "checkpoints" / name

    def _trainable_names(self) -> list[str]:
        return [k for k, v in self.model.named_parameters() if v.requires_grad]

    def save_state(self, name: str, extra: dict[str, Any] | None = None, sampler: SamplingClient | None = None) -> Path:
        """Write the trainable weights (their fp32 master copies, if any), the optimizer, ``extra`` (e.g. the
        loop's step) and, if given, the weights of ``sampler`` (a stale sampler the loop keeps using; read it
        back with :meth:`load_sampler`) to one file. The file appears only when complete (written to a
        temporary name, then renamed), so a run killed at any moment leaves the previous checkpoints readable."""
        path = self._state_path(name)
        clash = file_in_the_way(path)
        if clash is not None:
            raise NotADirectoryError(
                f"cannot save state {name!r}: {clash}. The weights are still in memory: set this client's log_dir "
                "to a folder (checkpoints go to <log_dir>/checkpoints) and call save_state again."
            )
        path.mkdir(parents=True, exist_ok=True)
        names = self._trainable_names()
        values = self._master if self._master is not None else self.trainable_parameters()
        sampler_params = dict(sampler.model.named_parameters()) if sampler is not None else {}
        state = {
            "weights": {k: v.detach().cpu() for k, v in zip(names, values)},
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "extra": extra or {},
            "sampler": {k: sampler_params[k].detach().cpu() for k in names} if sampler is not None else None,
        }
        tmp = path / "state.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path / "state.pt")
        return path

    def _read_state(self, path: str | Path) -> tuple[Path, dict[str, Any]]:
        file = Path(path) / "state.pt" if Path(path).is_dir() else Path(path)
        if not file.exists():
            raise FileNotFoundError(f"no saved state at {file}; pass a folder written by save_state")
        return file, torch.load(file, map_location=self.device, weights_only=False)

    def load_state(self, path: str | Path, optimizer: bool = True) -> dict[str, Any]:
        """Restore weights and optimizer written by :meth:`save_state`. Returns its ``extra`` dict.

        ``optimizer=False`` restores the weights only and starts a fresh optimizer (Tinker's ``load_state``: "weights
        only, optimizer resets"; its ``load_state_with_optimizer`` is the default here). A checkpoint saved before
        the first step holds no optimizer state, so loading it starts a fresh optimizer either way: the run goes on
        as the saved one would have, not with moments and a step count from steps taken after the save. Gradients
        accumulated by ``forward_backward`` and not yet stepped on are dropped with the weights they were taken at."""
        file, state = self._read_state(path)
        named = dict(self.model.named_parameters())
        unknown = [k for k in state["weights"] if k not in named]
        if unknown:
            raise ValueError(
                f"{file} holds weights this model lacks (e.g. {unknown[:3]}); was it saved from another model?"
            )
        trainable = self._trainable_names()
        missing = [k for k in trainable if k not in state["weights"]]
        if missing:  # they would keep their current values beside the loaded ones: a model that is neither
            raise ValueError(
                f"{file} lacks {len(missing)} of this model's {len(trainable)} trainable weights "
                f"(e.g. {missing[:3]}): it was saved from a model with fewer layers or another LoRA adapter. Load it "
                "into the model it was saved from."
            )
        wrong = [
            (k, tuple(v.shape), tuple(named[k].shape)) for k, v in state["weights"].items() if v.shape != named[k].shape
        ]
        if wrong:
            k, saved, here = wrong[0]
            raise ValueError(
                f"{file} holds {len(wrong)} weight(s) of another shape than this model's (e.g. {k}: {saved} saved, "
                f"{here} here): it was saved from a model of another size or LoRA rank. Nothing was loaded."
            )
        with torch.no_grad():
            for k, v in state["weights"].items():
                named[k].copy_(v)
        # gradients from forward_backward calls before the load belong to the weights that were replaced: the next
        # optim_step must apply only what is computed from the checkpoint on, as a fresh client's would
        for q in self.trainable_parameters():
            q.grad = None
        if self._stores_16_bit():
            # the saved fp32 master weights, not their rounded copies, carry on (written into the copies this client
            # has, if any: whatever still refers to them sees the loaded values)
            saved = [state["weights"][k].to(self.device, torch.float32) for k in trainable]
            if self._master is None:
                self._master = [torch.nn.Parameter(w.clone()) for w in saved]
            else:
                with torch.no_grad():
                    for m, w in zip(self._master, saved):
                        m.copy_(w)
        else:
            self._master = None
        self.optimizer = None  # built at the next optim_step, over the parameters it optimizes
        if optimizer and state["optimizer"] is not None:
            self.optimizer = torch.optim.AdamW(self._optimized_parameters())
            self.optimizer.load_state_dict(_step_counts_on_cpu(state["optimizer"]))
        return state["extra"]

    def load_sampler(self, path: str | Path) -> SamplingClient | None:
        """The sampler saved by ``save_state(..., sampler=...)``, or None if none was saved there."""
        _, state = self._read_state(path)
        if state.get("sampler") is None:
            return None
        sampler = self.save_weights_and_get_sampling_client("restored")
        named = dict(sampler.model.named_parameters())
        with torch.no_grad():
            for k, v in state["sampler"].items():
                named[k].copy_(v)
        return sampler


class ServiceClient:
    """Makes training clients from a base model: a path, a hub id, or a ``(model, tokenizer)`` pair."""

    def __init__(self, device: str | torch.device | None = None, log_dir: str | Path | None = None):
        self.device = device
        self.log_dir = log_dir

    def _load(self, base_model, lora):
        if isinstance(base_model, tuple):
            model, tokenizer = base_model
            model = copy.deepcopy(model)  # never train the caller's model in place
            if self.device is not None:
                model.to(self.device)
            if lora is not None:
                model = wrap_lora(model, lora)
            return model, tokenizer
        return load_policy(base_model, lora=lora, device=self.device)

    def create_lora_training_client(self, base_model, rank: int = 16, **lora_kwargs) -> TrainingClient:
        """Train a LoRA adapter (peft) on ``base_model``; the adapter switched off is the KL reference."""
        model, tokenizer = self._load(base_model, LoraSettings(rank=rank, **lora_kwargs))
        return TrainingClient(model, tokenizer, reference=None, log_dir=self.log_dir)

    def create_training_client(self, base_model, keep_reference: bool = True) -> TrainingClient:
        """Train every weight of ``base_model``. ``keep_reference`` keeps a frozen copy for KL penalties."""
        model, tokenizer = self._load(base_model, None)
        for q in model.parameters():
            q.requires_grad_(True)
        reference = frozen_copy(model) if keep_reference else None
        return TrainingClient(model, tokenizer, reference=reference, log_dir=self.log_dir)


__all__ = [
    "AdamParams",
    "NoGradientError",
    "disable_dropout",
    "frozen_copy",
    "ForwardBackwardOutput",
    "Future",
    "LOSS_FN_NAMES",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "ServiceClient",
    "TrainingClient",
]
