import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from edurl.llm.model import TinyLMConfig, build_tiny_lm
from edurl.llm.tokenizer import build_bpe_tokenizer, build_char_tokenizer

SMALL = TinyLMConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


def random_llama_family(arch: str, dtype=torch.float32, **overrides):
    """A random model: 4 query heads over 2 key/value heads (grouped-query attention); Qwen2 has q/k/v biases."""
    kw = dict(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
    )
    kw.update(overrides)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**kw)).to(dtype).eval()
    if arch == "qwen2":  # make the biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model


# A Qwen2.5-style ChatML template with a default system message, written for these tests.
QWEN_STYLE_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def char_tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def small_model(char_tokenizer):
    return build_tiny_lm(char_tokenizer, SMALL, seed=0)


def make_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here (no hub) with Qwen's ChatML special tokens and template."""
    corpus = ["You are a helpful assistant.", "What is 12+34? The answer is \\boxed{46}.", "user assistant system"] * 50
    tok = build_bpe_tokenizer(corpus, vocab_size=400, split="qwen2")  # as a real Qwen2 checkpoint's: it reloads
    tok.chat_template = QWEN_STYLE_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    """A randomly initialised Qwen2-architecture model and its tokenizer, saved to a temp folder."""
    path = tmp_path_factory.mktemp("qwen2-random")
    tok = make_bpe_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def open_files(folder) -> list[str]:
    """The files under ``folder`` that this process holds open (Linux's /proc/self/fd; elsewhere none are seen)."""
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        return []
    return sorted(t for t in (os.readlink(f) for f in fds.iterdir() if f.exists()) if t.startswith(str(folder)))
