import os

import pytest
import torch

from edurl.llm.policy import LoraSettings, load_policy
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.sampling import SamplingParams, sample


def test_loads_a_random_qwen2_saved_locally(qwen_dir):
    model, tok = load_policy(qwen_dir, device="cpu")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32 and not model.training
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    r = ChatMLRenderer(tok, default_system="You are a helpful assistant.")
    prompt = r.build_generation_prompt([{"role": "user", "content": "What is 12+34?"}])
    out = sample(
        model,
        [prompt],
        3,
        SamplingParams(max_tokens=5, seed=0, stop=r.get_stop_sequences()),
        pad_token_id=tok.pad_token_id,
    )
    assert len(out) == 3 and all(1 <= len(c.tokens) <= 5 for c in out)


def test_lora_wraps_and_starts_as_the_base_model(qwen_dir):
    base, _ = load_policy(qwen_dir, device="cpu")
    model, _ = load_policy(qwen_dir, lora=LoraSettings(rank=4, alpha=8), device="cpu")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    x = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():  # LoRA's B starts at zero, so the adapted model equals the base
        assert torch.allclose(model(x).logits, base(x).logits, atol=1e-6)
        with model.disable_adapter():
            assert torch.allclose(model(x).logits, base(x).logits, atol=1e-6)
    model_int, _ = load_policy(qwen_dir, lora=8, device="cpu")
    assert model_int.peft_config["default"].r == 8


def test_missing_path_and_file_are_explained(tmp_path, qwen_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_policy(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_policy("./runs/nothing-here")
    with pytest.raises(ValueError, match="is a file"):
        load_policy(qwen_dir / "config.json")
    (tmp_path / "empty").mkdir()  # a wrong folder once got transformers' "install sentencepiece or tiktoken"
    with pytest.raises(FileNotFoundError, match="folder without a config.json, so it holds no Hugging Face model"):
        load_policy(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not in the local cache"):
        load_policy("edurl-test/no-such-hub-model", local_files_only=True)


def test_a_hub_id_with_a_dot_loads_from_the_local_cache(tmp_path, qwen_dir):
    # 'Qwen/Qwen2.5-0.5B-Instruct' has a suffix ('.5B-Instruct') by pathlib's reading, and was once refused as a
    # missing folder before the hub cache was looked in; a fake offline cache holds the tiny model under that id
    import shutil
    import subprocess
    import sys

    repo = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct"
    shutil.copytree(qwen_dir, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    code = (
        "from edurl.llm.policy import load_policy\n"
        "model, tok = load_policy('Qwen/Qwen2.5-0.5B-Instruct', device='cpu', local_files_only=True)\n"
        "print(type(model).__name__)"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ForCausalLM" in out.stdout


def test_tokenizer_without_chat_template_is_refused(tmp_path, qwen_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_dir)
    tok.chat_template = None
    tok.save_pretrained(tmp_path)
    AutoModelForCausalLM.from_pretrained(qwen_dir).save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="no chat template"):
        load_policy(tmp_path, device="cpu")
    model, tok = load_policy(tmp_path, device="cpu", require_chat=False)
    assert model is not None


def test_the_course_tokenizer_beside_a_qwen2_tiny_model_is_refused(tmp_path, char_tokenizer):
    # AutoTokenizer reads it as Qwen2's byte-level BPE, which dropped every space and newline without an error
    from edurl.llm.model import TinyLMConfig, build_tiny_lm

    for arch in ("qwen2", "llama"):
        build_tiny_lm(
            char_tokenizer, TinyLMConfig(arch=arch, hidden_size=16, num_layers=1, num_heads=2)
        ).save_pretrained(tmp_path / arch)
        char_tokenizer.save_pretrained(tmp_path / arch)
    with pytest.raises(RuntimeError, match="drops spaces or newlines.*arch='llama'"):
        load_policy(tmp_path / "qwen2", device="cpu")
    _, tokenizer = load_policy(tmp_path / "llama", device="cpu")  # the course's own layout loads as before
    assert tokenizer.decode(tokenizer.encode("ab cd\nef", add_special_tokens=False)) == "ab cd\nef"


def test_unknown_lora_targets(qwen_dir):
    with pytest.raises(ValueError, match="none of the LoRA target modules"):
        load_policy(qwen_dir, lora=LoraSettings(target_modules=("c_attn",)), device="cpu")


@pytest.mark.cuda
def test_bf16_on_cuda(qwen_dir):
    model, _ = load_policy(qwen_dir, lora=4)
    assert next(model.parameters()).device.type == "cuda"
    assert model.get_base_model().dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["PROMPT_TUNING", "PREFIX_TUNING"])
def test_prompt_learning_adapters_are_refused_before_they_give_wrong_log_probs(qwen_dir, kind):
    # their virtual tokens live outside the KV cache the sampler and trainer build: prompt tuning crashed the
    # layer-by-layer decode, and prefix tuning sampled from the base model while reporting its log-probs as the
    # adapted model's (found by a differential fuzz of the two decode paths)
    from peft import PrefixTuningConfig, PromptTuningConfig, TaskType, get_peft_model

    from edurl.llm.clients import TrainingClient

    model, tok = load_policy(qwen_dir, device="cpu")
    config = {"PROMPT_TUNING": PromptTuningConfig, "PREFIX_TUNING": PrefixTuningConfig}[kind]
    adapted = get_peft_model(model, config(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3))
    for fast in (True, False):
        with pytest.raises(ValueError, match=f"sample cannot use a peft {kind} adapter.*Use a LoRA adapter"):
            sample(adapted, [[5, 6, 7]], 2, SamplingParams(max_tokens=3, seed=0), fast_decode=fast)
    with pytest.raises(ValueError, match=f"TrainingClient cannot use a peft {kind} adapter"):
        TrainingClient(adapted, tok)
    lora, _ = load_policy(qwen_dir, lora=4, device="cpu")
    assert len(sample(lora, [[5, 6, 7]], 2, SamplingParams(max_tokens=3, seed=0))) == 2
    TrainingClient(lora, tok)


def test_lora_on_a_saved_adapter_folder_trains_the_saved_adapter(qwen_dir, tmp_path):
    """transformers loads an adapter folder onto its base; get_peft_model then made a fresh adapter over it, with
    B = 0, so training "continued" from the base model (peft only warned)."""
    model, tok = load_policy(qwen_dir, lora=4, device="cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    model.save_pretrained(tmp_path / "adapter")
    tok.save_pretrained(tmp_path / "adapter")

    again, _ = load_policy(tmp_path / "adapter", lora=4, device="cpu")
    loaded = {n: p for n, p in again.named_parameters() if "lora_" in n}
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[n], saved[n]) for n in saved)  # not reset to zeros
    assert all(p.requires_grad for p in loaded.values())
    assert not any(p.requires_grad for n, p in again.named_parameters() if "lora_" not in n)
    with pytest.raises(ValueError, match="saved LoRA adapter of rank 4, and lora asks for rank 8: pass lora=4"):
        load_policy(tmp_path / "adapter", lora=8, device="cpu")


def test_a_tokenizer_that_reloads_with_other_ids_is_refused(tmp_path):
    """A Qwen2 folder with a BPE tokenizer that keeps digit runs whole reloaded as Qwen2's tokenizer class, which
    splits every digit: "12+34" became other ids than the model was trained on, and load_policy said nothing."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from edurl.llm.tokenizer import build_bpe_tokenizer

    corpus = ["What is 12+34? The answer is \\boxed{46}.", "user assistant system"] * 50
    for split in ("gpt2", "qwen2"):
        tok = build_bpe_tokenizer(corpus, vocab_size=300, split=split)
        config = Qwen2Config(
            vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
        Qwen2ForCausalLM(config).save_pretrained(tmp_path / split)
        tok.save_pretrained(tmp_path / split)
    with pytest.raises(
        RuntimeError, match=r"Qwen2Tokenizer, which encodes .* but the folder's tokenizer.json .*'qwen2'"
    ):
        load_policy(tmp_path / "gpt2", device="cpu")
    _, tok = load_policy(tmp_path / "qwen2", device="cpu")  # Qwen2's own split reloads with the same ids
    # another model type is not the known trap: a difference is reported, and the weights still load
    import edurl.llm.policy as policy
    from edurl.llm.model import TinyLMConfig, build_tiny_lm

    gpt2_split = build_bpe_tokenizer(corpus, vocab_size=300)
    build_tiny_lm(gpt2_split, TinyLMConfig(hidden_size=16, num_layers=1, num_heads=2)).save_pretrained(
        tmp_path / "llama"
    )
    gpt2_split.save_pretrained(tmp_path / "llama")
    real = policy.AutoTokenizer.from_pretrained
    try:  # a reader that cuts digits as Qwen2's does, on a llama folder
        policy.AutoTokenizer.from_pretrained = lambda *a, **k: real(tmp_path / "qwen2")
        with pytest.warns(UserWarning, match="other ids than it was trained on. Check that the tokenizer"):
            model, _ = load_policy(tmp_path / "llama", device="cpu")
    finally:
        policy.AutoTokenizer.from_pretrained = real
    assert type(model).__name__ == "LlamaForCausalLM"
    saved = build_bpe_tokenizer(corpus, vocab_size=300, split="qwen2")
    assert tok.encode("12+34=?\n46", add_special_tokens=False) == saved.encode("12+34=?\n46", add_special_tokens=False)


def test_bad_inputs_are_refused_before_the_weights_load(tmp_path, qwen_dir, monkeypatch):
    """lora=True became rank True and lora=2.0 an AttributeError inside peft, a missing chat template and lora=0
    were refused after the weights had loaded (a 0.5B checkpoint's take a while), and a folder without tokenizer
    files got transformers' "install sentencepiece or tiktoken"."""
    import shutil

    import edurl.llm.policy as policy

    loads = []
    real = policy.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(
        policy.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a[0]) or real(*a, **k)
    )
    for bad in (True, 2.0, 0, -2, LoraSettings(rank=0), "16"):
        with pytest.raises(ValueError, match="lora must be a LoRA rank"):
            load_policy(qwen_dir, lora=bad, device="cpu")
    bare = tmp_path / "no_template"
    shutil.copytree(qwen_dir, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config = bare / "tokenizer_config.json"
    import json

    settings = json.loads(config.read_text())
    settings.pop("chat_template", None)
    config.write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="no chat template"):
        load_policy(bare, device="cpu")
    assert loads == []
    untokenized = tmp_path / "no_tokenizer"
    untokenized.mkdir()
    shutil.copy(qwen_dir / "config.json", untokenized)
    with pytest.raises(FileNotFoundError, match="holds no tokenizer .*tokenizer.save_pretrained"):
        load_policy(untokenized, device="cpu")
    import numpy as np

    assert load_policy(qwen_dir, lora=np.int64(4), device="cpu")[0].peft_config["default"].r == 4
