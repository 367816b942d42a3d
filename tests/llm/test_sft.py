import torch

from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.sft import SFTConfig, _batch, load_or_train_sft, sft_loss, train_sft
from edurl.llm.tasks import make_problem

from .conftest import SMALL

TINY = SFTConfig(model=SMALL, max_steps=4, batch_size=8, warmup_steps=2, num_threads=1, target_pass_at_1=None)


def test_loss_counts_only_reply_tokens(char_tokenizer, small_model):
    r = ChatMLRenderer(char_tokenizer)
    problems = [make_problem(12, "+", 34), make_problem(5, "+", 7)]
    tokens, mask, weights = _batch(r, problems, char_tokenizer.pad_token_id)
    got = sft_loss(small_model, tokens, mask, weights)
    # slow reference: one sequence at a time, only the reply "\boxed{N}<|im_end|>" is scored
    nll = []
    for p in problems:
        prompt = r.build_generation_prompt(p.messages())
        reply = char_tokenizer.encode(p.demonstration(), add_special_tokens=False) + r.get_stop_sequences()
        logits = small_model(torch.tensor([prompt + reply])).logits[0]
        for i, tok in enumerate(reply):
            nll.append(-torch.log_softmax(logits[len(prompt) - 1 + i], -1)[tok])
    assert torch.allclose(got, torch.stack(nll).mean(), atol=1e-5)


def test_training_is_deterministic_and_lowers_the_loss():
    _, _, h1 = train_sft(TINY, progress=False, num_eval=4)
    _, _, h2 = train_sft(TINY, progress=False, num_eval=4)
    assert [r["loss"] for r in h1] == [r["loss"] for r in h2]
    longer = SFTConfig(**{**TINY.__dict__, "max_steps": 40})
    _, _, h = train_sft(longer, progress=False, num_eval=4)
    assert h[-1]["loss"] < 0.6 * h[0]["loss"]  # 4.6 -> about 2.4 when measured
    assert {"pass_at_1", "format"} <= set(h[-1])


def test_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("EDURL_CACHE", str(tmp_path))
    model, tok, hist, path = load_or_train_sft(TINY, progress=False)
    assert path == tmp_path / "sft" / TINY.key() and (path / "config.json").is_file()
    again, tok2, hist2, path2 = load_or_train_sft(TINY, progress=False)
    assert path2 == path and hist2 == hist
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    assert tok2.encode("1+2=?") == tok.encode("1+2=?")
    other = SFTConfig(**{**TINY.__dict__, "seed": 1})
    assert other.key() != TINY.key()
    assert SFTConfig(**{**TINY.__dict__, "styled": True}).key() != TINY.key()


def test_plain_keys_are_those_of_checkpoints_cached_before_styled_existed(monkeypatch):
    monkeypatch.delenv("EDURL_MAX_THREADS", raising=False)  # make test caps threads, and the key names them
    # the default (Chapter 6's) and the 1-digit key: changing them would orphan every learner's cached checkpoint
    assert SFTConfig().key() == "fe73abf62b2275ac" and SFTConfig(num_digits=1).key() == "e73e1a5f423c425d"


def test_key_names_the_threads_that_actually_train(monkeypatch):
    # under EDURL_MAX_THREADS=1 a 2-thread config trains on 1 thread: its checkpoint is the 1-thread one
    monkeypatch.setenv("EDURL_MAX_THREADS", "1")
    assert SFTConfig(num_threads=2).key() == SFTConfig(num_threads=1).key()
    monkeypatch.delenv("EDURL_MAX_THREADS")
    assert SFTConfig(num_threads=2).key() != SFTConfig(num_threads=1).key()


def test_stops_at_the_validation_target():
    # a target of 0 is reached at the first check, so training stops after check_every steps
    config = SFTConfig(**{**TINY.__dict__, "max_steps": 20, "target_pass_at_1": 0.0, "check_every": 5, "num_valid": 4})
    _, _, history = train_sft(config, progress=False, num_eval=4)
    assert len(history) == 5 and history[-1]["valid_pass_at_1"] >= 0.0
    unreachable = SFTConfig(**{**config.__dict__, "target_pass_at_1": 1.0})  # not within 20 steps
    _, _, history = train_sft(unreachable, progress=False, num_eval=4)
    assert len(history) == 20 and sum("valid_pass_at_1" in r for r in history) == 4
