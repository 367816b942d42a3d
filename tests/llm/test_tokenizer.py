import pytest
from transformers import AutoTokenizer

from edurl.llm.tokenizer import CHATML_TEMPLATE, IM_END, IM_START, build_char_tokenizer


def test_one_token_per_character(char_tokenizer):
    text = "12+34=?\n\\boxed{46} x"
    ids = char_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert char_tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids(char_tokenizer):
    ids = char_tokenizer.encode(f"{IM_START}user\nhi{IM_END}", add_special_tokens=False)
    assert ids[0] == char_tokenizer.convert_tokens_to_ids(IM_START)
    assert ids[-1] == char_tokenizer.eos_token_id == char_tokenizer.convert_tokens_to_ids(IM_END)
    assert len(ids) == 2 + len("user\nhi")
    assert char_tokenizer.pad_token_id is not None and char_tokenizer.pad_token_id != char_tokenizer.eos_token_id


def test_unknown_characters_map_to_unk(char_tokenizer):
    ids = char_tokenizer.encode("aé", add_special_tokens=False)
    assert ids[1] == char_tokenizer.unk_token_id


def test_chat_template_renders_chatml(char_tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1=?"}]
    text = char_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1=?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_save_and_autotokenizer_round_trip(char_tokenizer, tmp_path):
    char_tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "What is 99-17? \\boxed{82}"
    assert loaded.encode(text, add_special_tokens=False) == char_tokenizer.encode(text, add_special_tokens=False)
    assert loaded.chat_template == CHATML_TEMPLATE
    assert (loaded.pad_token_id, loaded.eos_token_id) == (char_tokenizer.pad_token_id, char_tokenizer.eos_token_id)
    assert loaded.padding_side == "left"
    msgs = [{"role": "user", "content": "2+2=?"}]
    assert loaded.apply_chat_template(msgs, tokenize=False) == char_tokenizer.apply_chat_template(msgs, tokenize=False)


def test_custom_alphabet():
    tok = build_char_tokenizer("0123456789+-=?")
    assert len(tok) == 5 + 14
    assert tok.decode(tok.encode("12+3=?", add_special_tokens=False)) == "12+3=?"


def test_round_trip_next_to_the_tiny_models_config(char_tokenizer, tmp_path):
    """AutoTokenizer picks a class from config.json's model type; ours must survive that."""
    from edurl.llm.model import TinyLMConfig, build_tiny_lm

    build_tiny_lm(
        char_tokenizer, TinyLMConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    ).save_pretrained(tmp_path)
    char_tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>user\n12 + 34=?<|im_end|>\n"
    assert loaded.encode(text, add_special_tokens=False) == char_tokenizer.encode(text, add_special_tokens=False)


def test_bpe_tokenizer_merges_and_round_trips(tmp_path):
    from transformers import AutoTokenizer

    from edurl.llm.tokenizer import build_bpe_tokenizer

    tok = build_bpe_tokenizer(["higher lower correct"] * 20, vocab_size=300)
    ids = tok.encode("higher", add_special_tokens=False)
    assert len(ids) < len("higher")  # merged: one text, fewer tokens than characters
    assert tok.decode(ids) == "higher"
    assert len(tok.encode("<|im_start|>", add_special_tokens=False)) == 1
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).encode("higher", add_special_tokens=False) == ids
    with pytest.raises(ValueError, match="corpus"):
        build_bpe_tokenizer([])
