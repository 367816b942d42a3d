import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.sft import SFTConfig, _batch, cached_checkpoint, load_or_train_sft, reply_budget, sft_loss, train_sft
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


def _mapped(folder) -> list[str]:
    """Files under ``folder`` that this process has memory-mapped (Linux's /proc/self/maps)."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return sorted({line.split()[-1] for line in maps if str(folder) in line})


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_a_cached_checkpoint_is_read_off_its_file(tmp_path, monkeypatch):
    """A model loaded from safetensors kept the file mapped while it lived, and Windows refuses to delete a mapped
    file: load_or_train_sft(retrain=True) in a kernel that had loaded it deleted half the folder, then failed."""
    monkeypatch.setenv("EDURL_CACHE", str(tmp_path))
    model, *_ = load_or_train_sft(TINY, progress=False)
    again, _, _, path = load_or_train_sft(TINY, progress=False)
    assert _mapped(path) == []
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_a_cache_under_a_file_is_named_before_training(tmp_path, monkeypatch):
    """$EDURL_CACHE pointing at a file (or under one) trained the whole warm start, then failed in mkdir with a bare
    NotADirectoryError, and the trained model was lost."""
    (tmp_path / "notes.txt").write_text("keep me")
    trained = []
    for cache in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "cache"):
        monkeypatch.setenv("EDURL_CACHE", str(cache))
        with pytest.raises(NotADirectoryError, match=r"EDURL_CACHE.*nothing was trained"):
            cached_checkpoint("key", TINY, lambda: trained.append(1))
    assert trained == [] and (tmp_path / "notes.txt").read_text() == "keep me"


def test_a_retrain_that_cannot_move_the_old_checkpoint_keeps_it(tmp_path, monkeypatch):
    """retrain=True deleted the old folder in place; a file it could not delete (open elsewhere, on Windows) stopped
    it halfway, with the tokenizer gone and the new checkpoint in a stray folder. Now the old one is moved aside
    whole first, and if that fails, nothing is lost."""
    monkeypatch.setenv("EDURL_CACHE", str(tmp_path))
    model, _, history, path = load_or_train_sft(TINY, progress=False)
    real_replace = os.replace

    def refusing(refuse):
        def replace(src, dst):
            if refuse(Path(src), Path(dst)):
                raise PermissionError(32, "The process cannot access the file because it is being used", str(src))
            return real_replace(src, dst)

        return replace

    cases = [
        (lambda src, dst: src == path, "could not move the cached checkpoint .* it is unchanged"),
        # the old one moves aside, the new one cannot move in
        (
            lambda src, dst: dst == path and "-earlier-" not in str(src),
            "trained checkpoint.*earlier checkpoint is back",
        ),
    ]
    for refuse, message in cases:
        monkeypatch.setattr(os, "replace", refusing(refuse))
        with pytest.raises(RuntimeError, match=message):
            load_or_train_sft(TINY, progress=False, retrain=True)
        monkeypatch.setattr(os, "replace", real_replace)
        assert [p.name for p in path.parent.iterdir()] == [path.name]  # no stray folders
        assert load_or_train_sft(TINY, progress=False)[2] == history  # the earlier checkpoint, loadable
    retrained, _, _, again = load_or_train_sft(TINY, progress=False, retrain=True)  # and a retrain that can, does
    assert again == path and [p.name for p in path.parent.iterdir()] == [path.name]
    loaded, *_ = load_or_train_sft(TINY, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(retrained.state_dict().values(), loaded.state_dict().values()))


def test_plain_keys_are_those_of_checkpoints_cached_before_styled_existed(monkeypatch):
    monkeypatch.delenv("EDURL_MAX_THREADS", raising=False)  # make test caps threads, and the key names them
    # Chapter 6's config and the 1-digit one as they were before extra_steps: changing their keys would orphan every
    # learner's cached checkpoint. extra_steps (on by default) changes what a seed that misses its target trains, so
    # the default's key changed with it, once.
    old = SFTConfig(extra_steps=0)
    assert old.key() == "fe73abf62b2275ac" and SFTConfig(num_digits=1, extra_steps=0).key() == "e73e1a5f423c425d"
    assert SFTConfig().key() != old.key()
    assert SFTConfig(target_pass_at_1=None).key() == SFTConfig(target_pass_at_1=None, extra_steps=5).key()
    assert SFTConfig(extra_learning_rate=1e-3).key() != SFTConfig().key()


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
    unreachable = SFTConfig(**{**config.__dict__, "target_pass_at_1": 1.0, "extra_steps": 0})  # not within 20 steps
    with pytest.warns(UserWarning, match="did not reach"):
        _, _, history = train_sft(unreachable, progress=False, num_eval=4)
    assert len(history) == 20 and sum("valid_pass_at_1" in r for r in history) == 4


def test_grading_leaves_room_for_the_longest_reference_reply(char_tokenizer, monkeypatch):
    # validation and test once graded with evaluate's default 16 tokens: a perfect 9-digit reply was cut off
    from edurl.llm.tasks import ArithmeticTask

    renderer = ChatMLRenderer(char_tokenizer)
    plain = ArithmeticTask(num_digits=2, ops=("+",)).sample(50, split="test", seed=0)
    assert reply_budget(renderer, plain) == 16  # the course's 2-digit sums keep their budget
    long = ArithmeticTask(num_digits=9, ops=("+",)).sample(50, split="test", seed=0)
    budget = reply_budget(renderer, long)
    assert budget == max(len(renderer._encode(p.demonstration())) for p in long) + 1 > 16
    seen = []
    real = train_sft.__globals__["evaluate"]
    monkeypatch.setitem(
        train_sft.__globals__, "evaluate", lambda *a, **k: (seen.append(k["max_tokens"]), real(*a, **k))[1]
    )
    fields = {"max_steps": 5, "check_every": 5, "num_valid": 4, "num_digits": 9, "target_pass_at_1": 1.0}
    with pytest.warns(UserWarning, match="did not reach"):
        train_sft(SFTConfig(**{**TINY.__dict__, **fields, "extra_steps": 0}), progress=False, num_eval=4)
    assert len(seen) == 2 and min(seen) > 16


def test_training_goes_past_max_steps_at_the_final_rate_until_the_target_is_met():
    # the first check is after 6 steps, past max_steps=4: without extra_steps that run would stop unchecked
    config = SFTConfig(
        **{**TINY.__dict__, "target_pass_at_1": 0.0, "check_every": 6, "num_valid": 4, "extra_steps": 10}
    )
    _, _, history = train_sft(config, progress=False, num_eval=4)
    assert len(history) == 6 and history[-1]["target_met"] is True
    lrs = [r["lr"] for r in history]
    assert lrs[4] == lrs[5] == config.extra_learning_rate == config.learning_rate / 2  # a warm restart at half the peak
    assert lrs[:4] == [r["lr"] for r in train_sft(TINY, progress=False, num_eval=4)[2]]  # the schedule itself unchanged


def test_a_target_missed_after_the_extra_steps_warns_and_keeps_the_model():
    config = SFTConfig(**{**TINY.__dict__, "target_pass_at_1": 1.0, "check_every": 2, "num_valid": 4, "extra_steps": 2})
    with pytest.warns(UserWarning, match=r"did not reach target_pass_at_1=1.0 .* in 6 steps .*Raise extra_steps"):
        model, _, history = train_sft(config, progress=False, num_eval=4)
    assert len(history) == 6 and history[-1]["target_met"] is False and model is not None


def test_a_run_shorter_than_one_check_warns_instead_of_failing():
    config = SFTConfig(**{**TINY.__dict__, "target_pass_at_1": 0.5, "check_every": 10, "extra_steps": 0})
    with pytest.warns(UserWarning, match="no check: fewer steps than check_every=10"):
        _, _, history = train_sft(config, progress=False, num_eval=4)
    assert len(history) == 4 and history[-1]["target_met"] is False


def test_a_missed_target_warns_at_the_learners_call(tmp_path, monkeypatch):
    # load_or_train_sft trains through cached_checkpoint: the warning pointed at a line of sft.py, not at the call
    monkeypatch.setenv("EDURL_CACHE", str(tmp_path))
    config = SFTConfig(**{**TINY.__dict__, "target_pass_at_1": 0.5, "check_every": 10, "extra_steps": 0})
    with pytest.warns(UserWarning, match="did not reach") as record:
        load_or_train_sft(config, progress=False)
    assert [r.filename for r in record if "did not reach" in str(r.message)] == [__file__]


def test_train_sft_refuses_num_eval_0_before_it_trains():
    # it trained to the end, then its final evaluation raised "problems is empty", and the model was lost
    with pytest.raises(ValueError, match="num_eval must be a whole number"):
        train_sft(TINY, progress=False, num_eval=0)


def test_a_float64_model_gets_a_float64_loss(small_model, char_tokenizer):
    # the logits were cast to float32, which capped a float64 model's gradient checks at about 1e-7
    import copy

    model = copy.deepcopy(small_model).double()
    tokens = torch.tensor([char_tokenizer.encode("7+5=12")])
    mask, weights = torch.ones_like(tokens), torch.ones(tokens.shape, dtype=torch.float64)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=tokens).logits[0, :-1], -1)  # float64 throughout
        want = -logp.gather(-1, tokens[0, 1:, None]).mean()
        assert abs(sft_loss(model, tokens, mask, weights).item() - want.item()) < 1e-12


@pytest.mark.parametrize("make", ["sft", "game"])
def test_a_warmup_longer_than_the_run_is_named(make, recwarn):
    from edurl.llm.multiturn import GameSFTConfig

    cls = SFTConfig if make == "sft" else GameSFTConfig
    default_warmup = cls().warmup_steps
    with pytest.warns(UserWarning, match=rf"warmup_steps={default_warmup} is more than max_steps=20") as caught:
        cls(max_steps=20)  # a learner's short run, with the default warm-up
    assert "short of its peak" in str(caught[0].message) and "warmup_steps=max(1, max_steps // 10)" in str(
        caught[0].message
    )
    assert caught[0].filename == __file__  # pointed at the learner's call, not the library
    with pytest.warns(UserWarning, match="warmup_steps") as caught:
        replace(cls(max_steps=20), seed=1)  # as the library's loops remake a config: once pointed at dataclasses.py
    assert {w.filename for w in caught} == {__file__}
    recwarn.clear()
    cls(max_steps=default_warmup)  # a warm-up as long as the run reaches the peak on its last step
    assert not [w for w in recwarn if "warmup_steps" in str(w.message)]
