"""Offline RL from a rollout buffer (edurl.llm.offline) and DRO's soft advantage (losses.soft_advantages)."""

import math
from dataclasses import replace

import pytest
import torch

from edurl.llm import losses as L
from edurl.llm.loop import make_training_client
from edurl.llm.offline import RolloutBuffer, collect_buffer, offline_step, train_offline

from .test_grpo import TINY_SFT, _cache, tiny  # noqa: F401  (_cache: the per-session warm-start cache)

WARM = replace(TINY_SFT, max_steps=150)


def test_soft_advantages_by_hand():
    a = L.soft_advantages(torch.tensor([[1.0, 0.0]]), 1.0)
    baseline = math.log((math.e + 1) / 2)  # log mean(e^1, e^0)
    assert torch.allclose(a, torch.tensor([[1 - baseline, -baseline]]))
    r = torch.tensor([[1.0, 0.0, 0.5, 1.0], [0.2, 0.2, 0.2, 0.2]])
    assert torch.allclose(L.soft_advantages(r, 1e5), L.group_advantages(r), atol=1e-5)  # large tau: the mean
    assert torch.equal(L.soft_advantages(r, 0.0), torch.tensor([[0.0, -1.0, -0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert torch.allclose(L.soft_advantages(r, 1e-3), L.soft_advantages(r, 0.0), atol=1e-3)  # no overflow
    for tau in (1e12, 1e16, 1e300):  # it once rounded exp((R - max) / tau) to 1 and gave the max's baseline
        assert torch.allclose(L.soft_advantages(r, tau), L.group_advantages(r), atol=1e-6), tau
    assert L.soft_advantages(r, 0.3)[1].eq(0).all()  # a uniform group carries nothing
    with pytest.raises(ValueError, match="tau must be"):
        L.soft_advantages(r, -1.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("EDURL_CACHE", str(tmp_path_factory.getbasetemp() / "edurl-cache"))
    root = tmp_path_factory.mktemp("offline")
    config = tiny(root, sft=WARM, max_tokens=14, batch_size=4, max_steps=4, eval_every=4)
    trainer, renderer, task = make_training_client(config)
    start = trainer.save_weights_and_get_sampling_client("sft")
    yield config, trainer, renderer, task, start, root
    mp.undo()


def test_buffer_holds_what_the_loss_needs_and_round_trips(setup):
    config, trainer, renderer, task, start, root = setup
    buffer = collect_buffer({"sft": start}, renderer, task, 6, group_size=4, max_tokens=14, progress_bar=False)
    assert len(buffer) == 6 and buffer.source == ["sft"] * 6
    for comps, lps in zip(buffer.completions, buffer.logprobs):
        assert len(comps) == 4 and [len(c) for c in comps] == [len(lp) for lp in lps]
    again = RolloutBuffer.load(buffer.save(root / "b.pt"))
    assert again == buffer
    both = buffer + again
    assert len(both) == 12
    table = both.summary()
    assert table.loc["sft", "groups"] == 12
    assert table.loc["sft", "correct"] == pytest.approx(sum(map(sum, buffer.correct)) / 24)
    with pytest.raises(FileNotFoundError, match="collect_buffer"):
        RolloutBuffer.load(root / "missing.pt")


def test_offline_training_uses_the_logged_logprobs(setup):
    config, trainer, renderer, task, start, root = setup
    # a buffer sampled by the warm start itself: step 0 is then on-policy, so sampler and trainer agree
    buffer = collect_buffer({"sft": start}, renderer, task, 8, group_size=4, max_tokens=14, progress_bar=False)
    run = train_offline(replace(config, loss_fn="dro", dro_beta=0.1, log_dir=str(root / "dro")), buffer)
    m = run.metrics
    assert m["optim/kl_sample_train_v2"].iloc[0] < 1e-9
    assert m["optim/kl_sample_train_v2"].iloc[-1] > 1e-6  # later steps train on what the start sampled
    assert m["optim/grad_norm"].gt(0).all()
    # a buffer from another policy (the start after these steps) is off-policy from step 0
    moved = run.trainer.save_weights_and_get_sampling_client("moved")
    other = collect_buffer({"moved": moved}, renderer, task, 8, group_size=4, max_tokens=14, progress_bar=False)
    off = train_offline(replace(config, loss_fn="dro", max_steps=1, log_dir=str(root / "other")), other)
    assert off.metrics["optim/kl_sample_train_v2"].iloc[0] > 1e-6


def test_offline_batches_get_soft_advantages(setup, monkeypatch):
    config, trainer, renderer, task, start, root = setup
    buffer = collect_buffer({"sft": start}, renderer, task, 4, group_size=4, max_tokens=14, progress_bar=False)
    seen = []
    real_update = train_offline.__globals__["update"]

    def spy(config, trainer, rollout):
        seen.append(rollout)
        return real_update(config, trainer, rollout)

    monkeypatch.setitem(train_offline.__globals__, "update", spy)
    train_offline(replace(config, loss_fn="dro", dro_beta=0.3, max_steps=1, log_dir=str(root / "spy")), buffer, "soft")
    train_offline(replace(config, loss_fn="dro", max_steps=1, log_dir=str(root / "mean")), buffer)  # the default
    train_offline(  # a learner's soft advantages, by function
        replace(config, loss_fn="dro", dro_beta=0.3, max_steps=1, log_dir=str(root / "fn")), buffer, L.soft_advantages
    )
    rollout, mean_rollout, fn_rollout = seen  # batch_size 4 of a 4-group buffer: every group, in some order
    rewards_of = {tuple(p): r for p, r in zip(buffer.prompts, buffer.rewards)}
    for k in range(0, 16, 4):
        group = rollout.datums[k : k + 4]
        first_action = int(group[0].loss_fn_inputs["mask"].nonzero()[0])
        prompt = tuple(group[0].model_input.tokens[: first_action + 1])
        expected = L.soft_advantages(torch.tensor([rewards_of[prompt]]), 0.3)[0]
        got = [float(d.loss_fn_inputs["advantages"][first_action]) for d in group]
        assert got == pytest.approx(expected.tolist(), abs=1e-6)
        mean = L.group_advantages(torch.tensor([rewards_of[prompt]]))[0]
        got_mean = [float(d.loss_fn_inputs["advantages"][first_action]) for d in mean_rollout.datums[k : k + 4]]
        assert got_mean == pytest.approx(mean.tolist(), abs=1e-6)
    assert [d.loss_fn_inputs["advantages"].tolist() for d in fn_rollout.datums] == [
        d.loss_fn_inputs["advantages"].tolist() for d in rollout.datums
    ]
    assert rollout.row["buffer/reward"] == pytest.approx(sum(map(sum, buffer.rewards)) / 16, abs=1e-6)


def test_the_buffer_keeps_its_temperature_and_the_trainer_must_match_it(setup):
    config, trainer, renderer, task, start, root = setup
    cold = collect_buffer(
        {"sft": start}, renderer, task, 4, group_size=4, max_tokens=14, temperature=0.5, progress_bar=False
    )
    assert cold.temperature == 0.5 and RolloutBuffer.load(cold.save(root / "cold.pt")).temperature == 0.5
    # log-probs logged at T = 0.5 are not pi_sampler at T = 1: it once trained on them without a word
    with pytest.raises(ValueError, match="temperature 0.5"):
        train_offline(replace(config, log_dir=str(root / "cold")), cold)
    with pytest.raises(ValueError, match="temperature 0.5"):
        offline_step(config, trainer, cold, 0)
    warm = collect_buffer({"sft": start}, renderer, task, 4, group_size=4, max_tokens=14, progress_bar=False)
    with pytest.raises(ValueError, match="temperatures 0.5 and 1.0"):
        cold + warm
    # a buffer saved before buffers kept their temperature loads, and is trusted
    old = {k: getattr(warm, k) for k in warm.__dataclass_fields__ if k != "temperature"}
    torch.save(old, root / "old.pt")
    legacy = RolloutBuffer.load(root / "old.pt")
    assert legacy.temperature is None
    with pytest.warns(UserWarning, match="one of unknown temperature"):
        assert (legacy + warm).temperature is None  # a join with an unknown part is unknown
    assert "optim/loss" in offline_step(replace(config, temperature=0.7), trainer, legacy, 0)


def test_offline_step_checks_the_groups_it_draws(setup):
    config, trainer, renderer, task, start, root = setup
    buffer = collect_buffer({"sft": start}, renderer, task, 4, group_size=4, max_tokens=14, progress_bar=False)
    buffer.correct = [[1.0] * 4 for _ in buffer.correct]
    assert offline_step(config, trainer, buffer, 0)["buffer/correct"] == 1.0
    # called directly with another group size, it once trained and logged buffer/correct = 2.0
    with pytest.raises(ValueError, match="group_size is 2"):
        offline_step(replace(config, group_size=2), trainer, buffer, 0)
    # Dr. GRPO divides by max_tokens: a logged completion longer than that would break its constant
    with pytest.raises(ValueError, match="max_tokens"):
        train_offline(replace(config, aggregation="seq_mean_token_sum_norm", max_tokens=2), buffer)


def test_offline_refuses_bad_inputs(setup):
    config, trainer, renderer, task, start, root = setup
    buffer = collect_buffer({"sft": start}, renderer, task, 2, group_size=4, max_tokens=14, progress_bar=False)
    with pytest.raises(ValueError, match="buffer holds 2"):
        train_offline(config, buffer)
    with pytest.raises(ValueError, match="buffer holds 2"):  # called directly, it once trained on 2 groups of 4
        offline_step(config, trainer, buffer, 0)
    with pytest.raises(ValueError, match="group_size"):
        train_offline(replace(config, batch_size=2, group_size=8), buffer)
    with pytest.raises(ValueError, match="advantage must be"):
        train_offline(replace(config, batch_size=2), buffer, advantage="max")
    with pytest.raises(ValueError, match="advantage must be"):  # called directly, before any work
        offline_step(replace(config, batch_size=2), trainer, buffer, 0, advantage="max")
    with pytest.raises(ValueError, match="samplers is empty"):
        collect_buffer({}, renderer, task, 2)


def test_a_buffer_whose_groups_do_not_line_up_is_refused(tmp_path):
    # 2 completions with 3 rewards used to train on a baseline of 2/3 instead of 1/2, and saved and loaded as well
    good = dict(prompts=[[1, 2]], completions=[[[3, 4], [5]]], logprobs=[[[-0.1, -0.2], [-0.3]]], rewards=[[1.0, 0.0]])
    ok = RolloutBuffer(**good, correct=[[1.0, 0.0]], source=["sft"])
    ok.save(tmp_path / "ok.pt")
    with pytest.raises(NotADirectoryError, match="lies under '.*ok.pt', which is a file. Pass a path in a folder"):
        ok.save(tmp_path / "ok.pt" / "again" / "b.pt")  # a bare "[Errno 20] Not a directory" from mkdir
    with pytest.raises(ValueError, match="group 0 has 2 completions but 2 lists of log-probs, 3 rewards"):
        RolloutBuffer(**{**good, "rewards": [[1.0, 0.0, 0.0]]}, correct=[[1.0, 0.0]], source=["sft"])
    with pytest.raises(ValueError, match="group 0, completion 1 has 1 tokens but 2 log-probs"):
        RolloutBuffer(**{**good, "logprobs": [[[-0.1, -0.2], [-0.3, -0.4]]]}, correct=[[1.0, 0.0]], source=["sft"])
    with pytest.raises(ValueError, match=r"different lengths .*'source': 0"):
        RolloutBuffer(**good, correct=[[1.0, 0.0]])
    filled = RolloutBuffer(**good, correct=[[1.0, 0.0]], source=["sft"])
    filled.rewards[0].append(0.0)  # collect_buffer fills the lists in place: save checks them again
    with pytest.raises(ValueError, match="3 rewards"):
        filled.save(tmp_path / "bad.pt")
    assert not (tmp_path / "bad.pt").exists()


def test_a_buffer_off_the_usual_path_says_what_is_wrong(tmp_path):
    """summary() of an empty buffer raised KeyError 'source' and a group with no completions ZeroDivisionError; a
    file with a newer version's field gave a bare TypeError; joining a buffer of known temperature with one of
    unknown temperature silently turned the temperature check off."""
    import warnings

    empty = RolloutBuffer(temperature=1.0)
    assert len(empty.summary()) == 0 and list(empty.summary().columns) == ["groups", "reward", "correct", "tokens"]
    with pytest.raises(ValueError, match="group 0 has no completions"):
        RolloutBuffer(prompts=[[1]], completions=[[]], logprobs=[[]], rewards=[[]], correct=[[]], source=["sft"])
    one = dict(prompts=[[1, 2]], completions=[[[3], [4]]], logprobs=[[[-0.1], [-0.2]]], rewards=[[1.0, 0.0]])
    buffer = RolloutBuffer(**one, correct=[[1.0, 0.0]], source=["sft"], temperature=1.0)
    assert buffer.summary().loc["sft", "groups"] == 1
    saved = torch.load(buffer.save(tmp_path / "b.pt"), weights_only=True)
    torch.save({**saved, "behaviour_policy": ["sft"]}, tmp_path / "newer.pt")
    with pytest.raises(ValueError, match=r"fields \['behaviour_policy'\] that this version of edurl does not know"):
        RolloutBuffer.load(tmp_path / "newer.pt")
    legacy = RolloutBuffer(**one, correct=[[1.0, 0.0]], source=["old"], temperature=None)
    with pytest.warns(UserWarning, match="temperature 1.0 with one of unknown temperature"):
        joined = buffer + legacy
    assert joined.temperature is None and len(joined) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (buffer + buffer).temperature == 1.0
        # an empty accumulator is not a legacy buffer: it keeps the other's temperature, without a warning
        assert (RolloutBuffer() + buffer).temperature == 1.0 and (buffer + RolloutBuffer()).temperature == 1.0
        assert sum([buffer, buffer], RolloutBuffer()).temperature == 1.0


def test_a_buffer_with_a_value_that_is_not_finite_is_refused_when_made():
    # a NaN reward once passed every check and made the step that first drew its group fail, after the warm start
    one = dict(prompts=[[1, 2]], completions=[[[3], [4]]], correct=[[1.0, 0.0]], source=["sft"])
    with pytest.raises(ValueError, match="group 0 has a reward that is not finite"):
        RolloutBuffer(**one, logprobs=[[[-0.1], [-0.2]]], rewards=[[1.0, float("nan")]])
    with pytest.raises(ValueError, match="group 0, completion 1 has a log-prob that is not finite"):
        RolloutBuffer(**one, logprobs=[[[-0.1], [-math.inf]]], rewards=[[1.0, 0.0]])


def test_offline_steps_honour_the_advantage_fields_of_the_config(setup, monkeypatch):
    # center_advantages and drop_uniform_groups were read by the online step only: offline, they changed nothing
    config, trainer, renderer, task, start, root = setup
    group = dict(completions=[[3], [4], [5], [6]], logprobs=[[-0.1], [-0.2], [-0.3], [-0.4]], correct=[0.0] * 4)
    buffer = RolloutBuffer(
        prompts=[[1, 2]] * 4,
        completions=[group["completions"]] * 4,
        logprobs=[group["logprobs"]] * 4,
        rewards=[[1.0, 0.0, 0.0, 0.0], [0.5] * 4, [0.5] * 4, [0.5] * 4],  # one mixed group, three uniform
        correct=[group["correct"]] * 4,
        source=["made"] * 4,
    )
    seen = []
    monkeypatch.setitem(offline_step.__globals__, "update", lambda config, trainer, rollout: seen.append(rollout) or {})
    advantages = lambda rollout: sorted(float(d.loss_fn_inputs["advantages"][-1]) for d in rollout.datums)  # noqa: E731
    offline_step(config, trainer, buffer, 0)
    offline_step(replace(config, center_advantages=False), trainer, buffer, 0)
    offline_step(replace(config, drop_uniform_groups=True), trainer, buffer, 0)
    centred, raw, dropped = seen
    assert advantages(centred) == pytest.approx([-0.25] * 3 + [0.0] * 12 + [0.75])
    assert advantages(raw) == pytest.approx([0.0] * 3 + [0.5] * 12 + [1.0])
    assert advantages(dropped) == pytest.approx([-0.25] * 3 + [0.75])  # the uniform groups' datums are gone
    with pytest.raises(ValueError, match="center_advantages=False .* advantage='mean' only"):
        offline_step(replace(config, center_advantages=False), trainer, buffer, 0, advantage="soft")


def test_a_resume_from_another_buffer_is_refused(setup):
    # the resumed steps drew their groups from the new buffer, and the run logged a mix of the two, without a word
    config, trainer, renderer, task, start, root = setup
    first = collect_buffer({"sft": start}, renderer, task, 4, group_size=4, max_tokens=14, progress_bar=False)
    other = collect_buffer({"sft": start}, renderer, task, 4, group_size=4, max_tokens=14, progress_bar=False, seed=1)
    assert first.fingerprint() == RolloutBuffer.load(first.save(root / "fp.pt")).fingerprint() != other.fingerprint()
    log_dir = str(root / "resume")
    train_offline(replace(config, max_steps=2, save_every=2, log_dir=log_dir), first)
    with pytest.raises(ValueError, match="trained on another buffer"):
        train_offline(replace(config, max_steps=4, save_every=2, log_dir=log_dir, resume=True), other)
    assert (
        len(train_offline(replace(config, max_steps=4, save_every=2, log_dir=log_dir, resume=True), first).metrics) == 4
    )


def test_train_offline_under_torchrun_is_refused_before_any_work(setup, monkeypatch):
    # every rank trained the whole run into one log_dir, and their metrics.jsonl lines ran into each other
    config, trainer, renderer, task, start, root = setup
    buffer = collect_buffer({"sft": start}, renderer, task, 4, group_size=4, max_tokens=14, progress_bar=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setitem(
        train_offline.__globals__["run_training_loop"].__globals__, "make_training_client", lambda c: 1 / 0
    )
    with pytest.raises(ValueError, match="started by torchrun with WORLD_SIZE=2 .* Start it with python"):
        train_offline(replace(config, log_dir=str(root / "torchrun")), buffer)
