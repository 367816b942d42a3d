"""A tiny decoder-only transformer, built from transformers' own Llama or Qwen2 code (Chapter 6).

The course model is a ``LlamaForCausalLM`` -- the decoder family of Llama, Qwen2.5 and
SmolLM2 (RMSNorm, rotary positions, SwiGLU MLP) -- about a thousand times smaller than
Qwen2.5-0.5B, so every line that runs it also runs the real thing:
``save_pretrained`` and ``AutoModelForCausalLM.from_pretrained`` work unchanged.

Why Llama and not Qwen2 by default: in transformers 5, ``AutoTokenizer.from_pretrained``
on a folder whose ``config.json`` says ``qwen2`` builds a ``Qwen2Tokenizer``, which
replaces our character-level pre-tokenizer with Qwen's BPE one and silently changes
the token ids. A ``llama`` folder keeps the tokenizer it was saved with. (A BPE tokenizer from
``build_bpe_tokenizer(corpus, split='qwen2')`` cuts text as Qwen2's does, and reloads with its ids;
``load_policy`` refuses a folder whose reloaded tokenizer encodes differently from the one saved.)
Dropout is 0, so a forward pass is a deterministic function of the weights --
the sampler's log-probs and the trainer's log-probs must agree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from edurl._checks import check_fields

ARCHITECTURES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


@dataclass
class TinyLMConfig:
    """Sizes of the course's tiny LM. The defaults train on a 2-core CPU in about a minute."""

    arch: str = "llama"
    """'llama' or 'qwen2' (see the module docstring before saving a 'qwen2' model with the char tokenizer)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 3
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads (query and key/value: no grouped-query attention at this size)."""
    intermediate_size: int = 384
    """Width of each block's MLP."""
    max_position_embeddings: int = 128
    """Longest sequence (prompt + completion) in tokens."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            positive_int=("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"),
            choices={"arch": tuple(ARCHITECTURES)},
        )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TinyLMConfig.hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if (self.hidden_size // self.num_heads) % 2:  # else the first forward pass failed inside the rotary code
            raise ValueError(
                f"TinyLMConfig: each head gets hidden_size / num_heads = {self.hidden_size // self.num_heads} "
                "dimensions, and rotary position embeddings rotate them in pairs, so it must be even; e.g. "
                f"hidden_size={2 * self.hidden_size} or num_heads={self.num_heads // 2 or 1}"
            )


def build_tiny_lm(
    tokenizer: PreTrainedTokenizerBase, config: TinyLMConfig | None = None, seed: int = 0
) -> PreTrainedModel:
    """A randomly initialised causal LM whose vocabulary matches ``tokenizer``."""
    config = config or TinyLMConfig()
    if config.arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {config.arch!r}")
    if config.hidden_size % config.num_heads:
        raise ValueError(f"hidden_size ({config.hidden_size}) must be divisible by num_heads ({config.num_heads})")
    config_cls, model_cls = ARCHITECTURES[config.arch]
    hf_config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings,
        attention_dropout=0.0,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(hf_config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()


def num_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def config_dict(config: TinyLMConfig) -> dict:
    return asdict(config)
