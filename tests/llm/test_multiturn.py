import pytest

from edurl.llm.envs.guess_number import demonstration
from edurl.llm.multiturn import (
    GameSFTConfig,
    MultiTurnConfig,
    conversation_example,
    evaluate_game,
    load_or_train_game_sft,
    train_multiturn,
)
from edurl.llm.renderer import ChatMLRenderer

from .conftest import SMALL
from .test_envs import ForgetfulRenderer

TINY = dict(model=SMALL, max_steps=3, batch_size=4, warmup_steps=1, num_threads=1)


def test_conversation_example_weights_every_assistant_reply_and_nothing_else(char_tokenizer):
    import random

    r = ChatMLRenderer(char_tokenizer)
    messages = demonstration(21, random.Random(1))
    tokens, weights = conversation_example(r, messages)
    trained = "".join(char_tokenizer.decode([t]) if w else "\0" for t, w in zip(tokens, weights))
    replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert [p for p in trained.split("\0") if p] == replies
    assert (
        tokens
        == r.build_generation_prompt(messages[:-1])
        + char_tokenizer.encode(messages[-1]["content"], add_special_tokens=False)
        + r.get_stop_sequences()
    )
    with pytest.raises(ValueError, match="prefix"):
        conversation_example(ForgetfulRenderer(char_tokenizer), messages)
    with pytest.raises(ValueError, match="no assistant"):
        conversation_example(r, messages[:1])


def test_demonstrations_are_legal_and_reproducible():
    c = GameSFTConfig()
    assert c.demonstrations(8, 3) == c.demonstrations(8, 3) != c.demonstrations(8, 4)
    calc = GameSFTConfig(game="calculator", tool_fraction=0.5).demonstrations(400, 0)
    share = sum(len(m) == 4 for m in calc) / len(calc)
    assert 0.4 < share < 0.6
    assert GameSFTConfig(game="calculator", tool_fraction=1.0).key() != GameSFTConfig(game="calculator").key()
    with pytest.raises(ValueError, match="game"):
        GameSFTConfig(game="chess")


def test_warm_start_caches_and_grpo_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("EDURL_CACHE", str(tmp_path / "cache"))
    sft = GameSFTConfig(**TINY)
    model, tok, hist, path = load_or_train_game_sft(sft, progress_bar=False)
    assert path.name == sft.key() and len(hist) == 3 and hist[-1]["loss"] < hist[0]["loss"]
    _, _, hist2, _ = load_or_train_game_sft(sft, progress_bar=False)
    assert hist2 == hist
    ev = evaluate_game(model, tok, "guess_number", max_tokens=8)
    assert set(ev) >= {"win", "guesses", "illegal", "reward/total"} and 0 <= ev["win"] <= 1
    config = MultiTurnConfig(
        sft=sft,
        group_size=2,
        batch_size=2,
        max_steps=2,
        eval_every=2,
        max_tokens=8,
        log_dir=str(tmp_path / "run"),
        num_threads=1,
        progress=False,
    )
    result = train_multiturn(config)
    assert len(result.metrics) == 2 and "test/win" in result.metrics.columns
    assert set(result.final) >= {"win", "guesses"}
