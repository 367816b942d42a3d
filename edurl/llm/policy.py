"""Load any Hugging Face causal LM as a policy, optionally with a LoRA adapter (Chapters 6 and 7).

The same call serves the course's tiny model (a folder written by
``save_pretrained``) and a real checkpoint such as ``Qwen/Qwen2.5-0.5B-Instruct``
(a local folder or a hub id, when its weights are present). On CUDA the model is
loaded in bfloat16; on CPU in float32.

LoRA (Hu et al., 2021) trains two small matrices per adapted layer instead of the
full weights. ``peft``'s ``disable_adapter()`` then gives back the base model,
which Chapter 7 uses as the KL reference without a second copy in memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from edurl._checks import is_whole
from edurl.llm.renderer import require_chat_template
from edurl.utils import device as default_device
from edurl.utils import warn_at_caller


@dataclass
class LoraSettings:
    """LoRA hyperparameters."""

    rank: int = 16
    """Rank r of the update B @ A."""
    alpha: float = 32.0
    """Scale: the update is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the LoRA input; 0 keeps sampling and training log-probs equal."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Names of the linear layers to adapt (those of Qwen2 and Llama blocks)."""


def _looks_like_path(name: str) -> bool:
    """Whether a name that is not an existing folder can only be meant as one. Not a dot in it: hub ids have them
    ('Qwen/Qwen2.5-0.5B-Instruct', whose pathlib suffix is '.5B-Instruct')."""
    return name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1


def check_model_path(name: str) -> Path:
    """Refuse, before anything loads, a model name that cannot be a checkpoint: a file, a folder without a
    ``config.json``, or a path (``./x``, ``/x``, ``~/x``) that does not exist. A hub id passes (whether its files
    are cached shows when they load). Returns the name as a path, ``~`` expanded."""
    path = Path(name).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name!r} is a file; pass the folder that holds config.json and the weights")
    if path.is_dir() and not any((path / f).is_file() for f in ("config.json", "adapter_config.json")):
        raise FileNotFoundError(
            f"{name!r} is a folder without a config.json, so it holds no Hugging Face model: pass a folder written by "
            "save_pretrained (config.json, the weights and the tokenizer's files), or a hub id."
        )
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")
    if path.is_dir() and not any((path / f).is_file() for f in tokenizer_files):
        raise FileNotFoundError(  # AutoTokenizer's own message asked for sentencepiece or tiktoken
            f"{name!r} holds no tokenizer (none of {', '.join(tokenizer_files)}): save the tokenizer beside the "
            "model, tokenizer.save_pretrained(folder), as well as model.save_pretrained(folder)."
        )
    if not path.exists() and _looks_like_path(name):
        raise FileNotFoundError(
            f"model path {name!r} does not exist. Pass a folder written by save_pretrained "
            "(e.g. the path returned by load_or_train_sft) or a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'."
        )
    return path


def load_policy(
    name_or_path: str | Path,
    lora: LoraSettings | int | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    require_chat: bool = True,
    local_files_only: bool = False,
):
    """Load a causal LM and its tokenizer. Returns ``(model, tokenizer)``.

    Parameters
    ----------
    name_or_path: a folder written by ``save_pretrained``, or a hub id whose files are cached locally.
    lora: ``None`` for full weights, an int rank, or :class:`LoraSettings`; wraps the model with peft (see below).
    device: defaults to :func:`edurl.device` (CUDA when available).
    dtype: defaults to bfloat16 on CUDA and float32 elsewhere.
    require_chat: raise if the tokenizer has no chat template (a base, non-instruct checkpoint).
    local_files_only: never try the network for a hub id (``HF_HUB_OFFLINE=1`` does the same).

    On a folder that holds a saved LoRA adapter (``adapter_config.json``), ``lora`` continues training the saved
    adapter on its base model, with the adapter's own alpha and target modules, and its rank must be the saved
    one; without ``lora`` the adapter is loaded frozen.
    """
    name = str(name_or_path)
    path = check_model_path(name)
    if lora is not None:
        check_lora(lora)
    dev = torch.device(device) if device is not None else default_device()
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    source = str(path) if path.exists() else name

    def missing(err: OSError) -> FileNotFoundError:
        return FileNotFoundError(
            f"could not load {name!r}: no such local folder, and the hub id is not in the local cache ({err}). "
            "Download the checkpoint on a machine with access, then pass its folder."
        )

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
    except OSError as err:
        raise missing(err) from None
    # the tokenizer's checks before the weights load: a 0.5B checkpoint took its time to be refused
    _require_whitespace_round_trip(tokenizer, source)
    _require_saved_ids(tokenizer, path if path.is_dir() else None, source)
    if require_chat:
        require_chat_template(tokenizer)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_files_only)
    except OSError as err:
        raise missing(err) from None
    if tokenizer.pad_token_id is None:  # sampling pads prompts on the left
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.to(dev).eval()
    if lora is not None and getattr(model, "_hf_peft_config_loaded", False):
        # the folder holds a saved LoRA adapter, which transformers loaded onto its base frozen; a fresh adapter
        # from get_peft_model would replace it with zeros (peft only warns), so train the saved one instead
        del model  # the copy with the frozen adapter: free it before the base loads again
        model = _trainable_saved_adapter(source, lora, dtype, dev, local_files_only)
    elif lora is not None:
        model = wrap_lora(model, lora)
    return model, tokenizer


def _require_whitespace_round_trip(tokenizer, source: str) -> None:
    """Refuse a tokenizer that loses every space or newline. AutoTokenizer reads the course's character
    tokenizer, saved beside a model of ``arch='qwen2'``, as Qwen2's byte-level BPE, whose vocabulary then lacks the
    byte symbols of a space and a newline: "hello world" decodes as "helloworld", and a chat prompt loses its line
    breaks, with no error. A real checkpoint's tokenizer keeps both."""
    probe = "ab cd\nef"
    decoded = tokenizer.decode(tokenizer.encode(probe, add_special_tokens=False))
    if " " not in decoded or "\n" not in decoded:
        raise RuntimeError(
            f"AutoTokenizer loaded {source!r} as {type(tokenizer).__name__}, which turns {probe!r} into "
            f"{decoded!r}: it drops spaces or newlines. A course model saved with TinyLMConfig(arch='qwen2') gives "
            "its character tokenizer to Qwen2's tokenizer class (see edurl/llm/model.py); save it with "
            "arch='llama', or load the tokenizer with edurl.llm.build_char_tokenizer()"
        )


def _require_saved_ids(tokenizer, folder: Path | None, source: str) -> None:
    """Refuse a tokenizer that encodes differently from the ``tokenizer.json`` saved in ``folder``, in a folder whose
    config says ``qwen2``, and warn elsewhere. AutoTokenizer reads a ``qwen2`` folder with Qwen2's tokenizer class,
    which builds its own pre-tokenizer (every digit a token of its own); the course's BPE tokenizer, saved beside a
    model of ``arch='qwen2'``, merges digits, so "12+34=?" became other ids than the model was trained on, with no
    error. A real Qwen2 checkpoint's file cuts text that way too, and passes. For other model types a difference is
    not a known trap, so it is reported, not refused (the weights still load)."""
    file = folder / "tokenizer.json" if folder is not None else None
    if file is None or not file.is_file():
        return
    from tokenizers import Tokenizer

    probe = "<|im_start|>user\n12 + 34=? The answer: 46.<|im_end|>\n"
    try:
        saved = Tokenizer.from_file(str(file)).encode(probe, add_special_tokens=False).ids
    except Exception:  # a tokenizer.json this version of tokenizers cannot read: AutoTokenizer's reading stands
        return
    loaded = tokenizer.encode(probe, add_special_tokens=False)
    if list(loaded) == list(saved):
        return
    message = (
        f"AutoTokenizer loaded {source!r} as {type(tokenizer).__name__}, which encodes {probe!r} as {list(loaded)}, "
        f"but the folder's tokenizer.json encodes it as {saved}: the model would read other ids than it was trained on"
    )
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        model_type = None
    if model_type != "qwen2":
        warn_at_caller(f"{message}. Check that the tokenizer loaded is the one the model was trained with.")
        return
    raise RuntimeError(
        f"{message}. A course model saved with TinyLMConfig(arch='qwen2') gives its own tokenizer to Qwen2's "
        "tokenizer class, which cuts text Qwen2's way (see edurl/llm/model.py): save it with arch='llama', or build "
        "a BPE tokenizer for it with build_bpe_tokenizer(corpus, split='qwen2')"
    )


def check_lora(lora) -> None:
    """Refuse, before anything loads, a ``lora`` that is neither a rank (an int >= 1) nor :class:`LoraSettings`
    with one: ``True`` became rank True and ``2.0`` an AttributeError deep in peft, after the model had loaded."""
    rank = lora.rank if isinstance(lora, LoraSettings) else lora
    if not is_whole(rank) or rank < 1:
        raise ValueError(
            f"lora must be a LoRA rank (an int >= 1, e.g. lora=16), LoraSettings(rank=...) or None for full weights; "
            f"got {'LoraSettings with rank ' if isinstance(lora, LoraSettings) else ''}{rank!r}"
        )


def _trainable_saved_adapter(source: str, lora: LoraSettings | int, dtype, dev, local_files_only: bool):
    """The base model with the adapter saved at ``source`` on it, trainable; its rank must be ``lora``'s (its alpha,
    dropout and target modules are the saved adapter's)."""
    from peft import PeftConfig, PeftModel

    saved = PeftConfig.from_pretrained(source, local_files_only=local_files_only)
    if getattr(saved, "peft_type", None) != "LORA":
        raise ValueError(
            f"{source!r} holds a saved {getattr(saved, 'peft_type', '?')} adapter, not LoRA: load it without lora= "
            "(frozen), or load its base model to train a LoRA adapter"
        )
    rank = lora.rank if isinstance(lora, LoraSettings) else int(lora)
    if getattr(saved, "r", None) != rank:
        raise ValueError(
            f"{source!r} holds a saved LoRA adapter of rank {getattr(saved, 'r', None)}, and lora asks for rank "
            f"{rank}: pass lora={getattr(saved, 'r', None)} to continue training the saved adapter, or load its "
            "base model to start a new one"
        )
    base = AutoModelForCausalLM.from_pretrained(
        saved.base_model_name_or_path, dtype=dtype, local_files_only=local_files_only
    )
    return PeftModel.from_pretrained(base.to(dev), source, is_trainable=True, local_files_only=local_files_only).eval()


def refuse_prompt_learning(model, who: str) -> None:
    """Raise if ``model`` carries a peft prompt-learning adapter (prompt, prefix or p-tuning).

    Such an adapter prepends virtual tokens (or their keys and values) inside peft's own forward. The sampler's
    prefill and decode and the trainer's shared-prompt passes feed the model a KV cache of their own, so the
    virtual tokens would be left out, or misplaced, and the log-probs would be wrong without any error."""
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        kind = getattr(getattr(config, "peft_type", None), "value", None) or type(config).__name__
        raise ValueError(
            f"{who} cannot use a peft {kind} adapter: its virtual tokens sit outside the KV cache that edurl's "
            "sampler and trainer build, so the sampled tokens and log-probs would be wrong. Use a LoRA adapter "
            "(edurl.llm.wrap_lora(model, 16), or load_policy(path, lora=16)) or train the full weights."
        )


def wrap_lora(model, lora: LoraSettings | int):
    """Wrap ``model`` with a peft LoRA adapter; only the adapter's weights stay trainable."""
    from peft import LoraConfig, get_peft_model

    check_lora(lora)
    settings = LoraSettings(rank=int(lora)) if not isinstance(lora, LoraSettings) else lora
    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    targets = [m for m in settings.target_modules if m in present]
    if not targets:
        raise ValueError(
            f"none of the LoRA target modules {settings.target_modules} exist in this model; "
            f"pass LoraSettings(target_modules=...) from its layer names"
        )
    return get_peft_model(
        model,
        LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout, target_modules=targets),
    )
