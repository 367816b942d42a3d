import math
import os
import shutil
import sys
from dataclasses import replace

import pytest
import torch

from edurl.llm import losses as L
from edurl.llm.grpo import CompletionTokens, GRPOConfig, problem_seed, train_grpo
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.sft import SFTConfig, _batch, continued_sft, load_or_train_sft, sft_loss
from edurl.metrics import load_metrics

from .conftest import SMALL, open_files

TINY_SFT = SFTConfig(model=SMALL, max_steps=30, batch_size=16, warmup_steps=2, num_threads=1, target_pass_at_1=None)


def tiny(tmp_path, **kw):
    base = dict(
        sft=TINY_SFT,
        group_size=4,
        batch_size=4,
        max_steps=6,
        max_tokens=8,
        eval_every=3,
        num_eval=8,
        num_threads=1,
        progress=False,
        log_dir=str(tmp_path / "run"),
        learning_rate=1e-3,
    )
    return GRPOConfig(**{**base, **kw})


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EDURL_CACHE", str(tmp_path_factory.getbasetemp() / "edurl-cache"))


COURSE_METRICS = [
    "env/all/reward/total",
    "env/all/correct",
    "env/all/format",
    "env/all/ac_tokens_per_turn",
    "env/all/by_group/frac_mixed",
    "env/all/by_group/frac_all_good",
    "env/all/by_group/frac_all_bad",
    "optim/entropy",
    "optim/kl_sample_train_v1",
    "optim/kl_sample_train_v2",
    "optim/clip_fraction",
    "time/sample",
    "time/train",
    "time/total",
]


def test_metrics_file_has_the_course_names(tmp_path):
    result = train_grpo(tiny(tmp_path))
    m = result.metrics
    assert list(m["step"]) == list(range(6))
    for name in COURSE_METRICS:
        assert name in m.columns, name
    assert m["test/pass_at_1"].notna().sum() == 2  # steps 3 and 6
    # one optimizer step per batch: the ratio is exactly 1, nothing is clipped
    assert (m["optim/clip_fraction"] == 0).all()
    assert m["optim/kl_sample_train_v1"].abs().max() < 1e-4


def test_substeps_engage_the_clip(tmp_path):
    m = train_grpo(
        tiny(
            tmp_path,
            loss_fn="ppo",
            num_substeps=4,
            learning_rate=3e-2,
            clip_low_threshold=0.99,
            clip_high_threshold=1.01,
            center_advantages=False,
        )
    ).metrics  # raw rewards: never all-zero
    assert m["optim/clip_fraction_last_substep"].max() > 0


@pytest.mark.parametrize("refresh_sampler", [True, False])
def test_resume_reproduces_an_uninterrupted_run(tmp_path, refresh_sampler):
    # eval_every=2, so the shorter run's final evaluation (step 3) is one the whole run also makes
    # raw rewards as advantages, so that every step moves the weights and Adam's moments matter.
    # With refresh_sampler=False the checkpoint must keep step 0's sampler: the old code rebuilt it from the
    # checkpoint's weights, so kl_sample_train_v1 was 0.0 after resuming but 0.155 in the whole run.
    kw = dict(save_every=2, eval_every=2, center_advantages=False, refresh_sampler=refresh_sampler)
    whole = train_grpo(tiny(tmp_path / "a", **kw)).metrics
    train_grpo(tiny(tmp_path / "b", max_steps=5, **kw))  # "interrupted" after 5 steps ...
    resumed = train_grpo(tiny(tmp_path / "b", resume=True, **kw)).metrics  # ... resumed from step 4
    assert whole["optim/entropy"].nunique() == 6
    cols = [c for c in whole.columns if not c.startswith("time/")]
    assert "optim/entropy" in cols and resumed["test/pass_at_1"].notna().sum() == 3
    assert list(resumed["step"]) == list(range(6))
    for c in cols:
        if c == "test/start_pass_at_1":
            continue
        a, b = whole[c].tolist(), resumed[c].tolist()
        assert a == pytest.approx(b, abs=0, nan_ok=True), c


def test_continued_sft_baseline_matches_the_sft_loss(tmp_path):
    config = tiny(tmp_path, max_steps=4, eval_every=2)
    # the loss of step 0, recomputed with Chapter 6's own SFT loss on the same problems and start
    model, tokenizer, _, _ = load_or_train_sft(config.sft)
    problems = config.sft.task().sample(
        config.batch_size * config.group_size, split="train", seed=problem_seed(config.seed, 0)
    )
    expected = sft_loss(model, *_batch(ChatMLRenderer(tokenizer), problems, tokenizer.pad_token_id)).item()
    result = continued_sft(config)
    m = result.metrics
    assert list(m["step"]) == [0, 1, 2, 3]
    assert m["optim/loss"][0] == pytest.approx(expected, rel=1e-5)
    assert m["optim/loss"].iloc[-1] < m["optim/loss"][0]  # lr 1e-3 on the demonstrations: the loss falls
    assert m["test/pass_at_1"].notna().sum() == 2 and result.start is not None
    assert "env/all/correct" not in m.columns  # nothing is sampled
    with pytest.raises(ValueError, match="resume=False"):
        continued_sft(tiny(tmp_path, resume=True))


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        tiny(tmp_path, group_size=1)
    with pytest.raises(ValueError, match="num_substeps"):
        tiny(tmp_path, num_substeps=3)
    with pytest.raises(ValueError, match="unknown loss"):
        tiny(tmp_path, loss_fn="grpo")
    with pytest.raises(ValueError, match="aggregation"):
        tiny(tmp_path, aggregation="mean")


def test_a_saved_hugging_face_model_with_lora(tmp_path, qwen_dir):
    """The path a learner with real weights takes: base_model is a folder (or hub id), trained through LoRA."""
    result = train_grpo(
        tiny(tmp_path, base_model=str(qwen_dir), lora_rank=4, max_steps=2, kl_coef=0.1, center_advantages=False)
    )
    m = result.metrics
    assert len(m) == 2 and m["optim/kl_ref"].notna().all()
    assert all("lora_" in n for n, p in result.trainer.model.named_parameters() if p.requires_grad)


def _metrics_without_times(m):
    return m[[c for c in m.columns if not c.startswith("time/")]]


@pytest.mark.skipif(sys.platform == "win32", reason="kills the run with SIGKILL, which Windows lacks")
def test_a_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
    """SIGKILL a GRPO run in a subprocess partway, resume it, and get the uninterrupted run's metrics."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from dataclasses import asdict

    config = tiny(tmp_path / "killed", max_steps=40, save_every=3, eval_every=5, center_advantages=False)
    load_or_train_sft(config.sft)  # the SFT warm start is cached before the clock starts
    fields = {k: v for k, v in asdict(config).items() if k != "sft"}
    script = (
        "import json, sys\n"
        "from edurl.llm.grpo import GRPOConfig, train_grpo\n"
        "from tests.llm.test_grpo import TINY_SFT\n"
        "train_grpo(GRPOConfig(sft=TINY_SFT, **json.loads(sys.argv[1])))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(fields)],
        env=os.environ.copy(),
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    checkpoints = tmp_path / "killed" / "run" / "checkpoints"
    deadline = time.time() + 300
    while not len(list(checkpoints.glob("step_*/state.pt"))) >= 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed; give it more steps"
    resumed = train_grpo(replace(config, resume=True)).metrics
    whole = train_grpo(
        tiny(tmp_path / "whole", max_steps=40, save_every=3, eval_every=5, center_advantages=False)
    ).metrics
    assert list(resumed["step"]) == list(range(40))
    a, b = _metrics_without_times(whole), _metrics_without_times(resumed)
    for c in a.columns:
        assert a[c].tolist() == pytest.approx(b[c].tolist(), abs=0, nan_ok=True), c


def test_kl_penalty_goes_into_the_reward_by_default(tmp_path):
    assert GRPOConfig().kl_penalty == "reward"
    with pytest.raises(ValueError, match="kl_penalty must be 'reward'"):
        tiny(tmp_path, kl_penalty="advantage")
    reward = train_grpo(tiny(tmp_path / "r", max_steps=3, kl_coef=0.5, center_advantages=False)).metrics
    loss = train_grpo(
        tiny(tmp_path / "l", max_steps=3, kl_coef=0.5, kl_penalty="loss", center_advantages=False)
    ).metrics
    assert reward["env/all/kl_sample_ref"].notna().all() and "env/all/kl_sample_ref" not in loss
    assert reward["optim/kl_ref"].notna().all() and loss["optim/kl_ref"].notna().all()
    # step 0 starts at the reference: no KL yet, so both runs take the same first step
    assert reward["env/all/kl_sample_ref"][0] == pytest.approx(0.0, abs=1e-6)
    assert reward["optim/loss"][0] == pytest.approx(loss["optim/loss"][0], abs=1e-6)


def test_sampling_temperature_is_matched_by_the_trainer(tmp_path):
    # learning_rate 0: nothing moves, so on-policy the ratio must be exactly 1 at any temperature
    m = train_grpo(tiny(tmp_path, max_steps=2, temperature=0.7, learning_rate=0.0, center_advantages=False)).metrics
    assert m["optim/kl_sample_train_v1"].abs().max() < 1e-5
    assert (m["optim/clip_fraction"] == 0).all()


def test_clip_range_defaults_to_each_losss_own(tmp_path):
    def bounds(**kw):
        config = tiny(tmp_path, **kw)
        return L.clip_bounds(config.loss_fn, config.loss_fn_config())

    assert tiny(tmp_path, loss_fn="cispo").loss_fn_config() == {}
    assert bounds(loss_fn="cispo") == (0.0, 4.0)
    assert bounds(loss_fn="ppo") == (0.8, 1.2)
    assert tiny(tmp_path, loss_fn="ppo", clip_high_threshold=1.28).loss_fn_config() == {"clip_high_threshold": 1.28}
    assert bounds(loss_fn="ppo", clip_high_threshold=1.28) == (0.8, 1.28)
    assert bounds(loss_fn="importance_sampling") == (0.8, 1.2)


def test_config_refuses_bad_values_and_a_conflicting_sft_seed(tmp_path):
    with pytest.raises(ValueError, match="needs clip_low_threshold <= clip_high_threshold"):
        tiny(tmp_path, loss_fn="ppo", clip_low_threshold=1.3)
    # DAPO's eps values passed as bounds: every on-policy ratio (1) was outside, so A > 0 never learned
    with pytest.raises(ValueError, match=r"leaves out r = 1.*pass \[0.8, 1.28\]"):
        tiny(tmp_path, loss_fn="ppo", clip_low_threshold=0.2, clip_high_threshold=0.28)
    with pytest.raises(ValueError, match="sft.seed=3 but seed=0"):
        tiny(tmp_path, sft=SFTConfig(seed=3))
    with pytest.raises(ValueError, match="learning_rate"):
        tiny(tmp_path, learning_rate=-1.0)
    with pytest.raises(ValueError, match="lora_rank"):
        tiny(tmp_path, lora_rank=0)
    with pytest.raises(
        ValueError, match="greedy sampling"
    ):  # every group uniform: it once trained on, learning nothing
        tiny(tmp_path, temperature=0.0)
    assert tiny(tmp_path, seed=3, sft=SFTConfig(seed=3)).seed == 3
    # a clip set for a loss without one was dropped without a word (DAPO's clip-higher on the default loss)
    for loss_fn in ("importance_sampling", "dro"):
        with pytest.raises(ValueError, match=f"loss_fn is '{loss_fn}', which has none"):
            tiny(tmp_path, loss_fn=loss_fn, clip_high_threshold=1.28)
    with pytest.raises(ValueError, match="kl_coef must be a finite number"):
        tiny(tmp_path, kl_coef=math.inf)
    for temperature in (math.inf, 1e-7):  # 1e-7 was refused by the sampler only, after the warm start
        with pytest.raises(ValueError, match="temperature must be a finite number >= 1e-6"):
            tiny(tmp_path, temperature=temperature)
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):  # True was taken as 1
        tiny(tmp_path, max_tokens=True)
    for name in ("kl_coef", "temperature", "learning_rate"):  # True was taken as 1.0
        for bad in (True, "1.0"):
            with pytest.raises(ValueError, match=f"GRPOConfig.{name} must be a number, got {bad!r}"):
                tiny(tmp_path, **{name: bad})


def test_a_step_fn_replaces_grpo_step(tmp_path):
    """Chapter 7's capstone: train_grpo(step_fn=...) runs the learner's step; the worked solution repeats the
    library's run (same problems, samples, rewards and held-out scores)."""
    from edurl.exercises.solutions.ch07 import grpo_step as solution

    library = train_grpo(tiny(tmp_path / "library"))
    own = train_grpo(tiny(tmp_path / "own"), step_fn=solution)
    for key in ("env/all/correct", "env/all/reward/total", "test/pass_at_1"):
        assert own.metrics[key].tolist() == pytest.approx(library.metrics[key].tolist(), nan_ok=True), key
    assert own.final.pass_at_1 == library.final.pass_at_1


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads Linux's /proc/self/fd")
def test_a_run_that_stops_midway_closes_its_metrics_file(tmp_path):
    """A step that raised (or a stopped notebook cell, whose traceback IPython keeps) left metrics.jsonl open; on
    Windows the next resume or overwrite in the same kernel then failed to replace or delete it."""

    def fails_at_step_1(config, trainer, renderer, task, step):
        if step == 1:
            raise KeyboardInterrupt
        return {"env/all/correct": 0.5}

    with pytest.raises(KeyboardInterrupt) as stopped:  # kept alive, as IPython keeps sys.last_traceback
        train_grpo(tiny(tmp_path, max_steps=3), step_fn=fails_at_step_1)
    assert stopped.traceback and open_files(tmp_path) == []
    assert load_metrics(tmp_path / "run")["step"].tolist() == [0]


def test_a_step_fn_must_return_a_dict_and_make_its_own_sampler(tmp_path):
    def forgot_return(config, trainer, renderer, task, step):
        return None

    with pytest.raises(TypeError, match="must return the step's metrics as a dict"):
        train_grpo(tiny(tmp_path, max_steps=1), step_fn=forgot_return)
    with pytest.raises(TypeError, match="step_fn must be a function"):
        train_grpo(tiny(tmp_path), step_fn="grpo_step")
    with pytest.raises(ValueError, match="refresh_sampler=True"):
        train_grpo(tiny(tmp_path, refresh_sampler=False), step_fn=forgot_return)


def test_a_reward_fn_replaces_the_verifiers_reward(tmp_path):
    """Chapter 8: train_grpo(reward_fn=...) trains on another reward; the verifier still grades for the metrics.
    A reward that is the verifier's own, returned through reward_fn, repeats the library's run exactly."""
    from edurl.llm.rewards import grade

    calls, stop_reasons = [], set()

    def verifier_again(problems, prompts, completions):
        renderer = ChatMLRenderer(load_or_train_sft(TINY_SFT, progress=False)[1])
        calls.append((len(problems), len(prompts), [len(g) for g in completions]))
        stop_reasons.update(c.stop_reason for group in completions for c in group)
        assert all(type(c) is CompletionTokens and isinstance(c, list) for g in completions for c in g)
        rewards = [
            [grade(*_content_and_ok(renderer, c), problems[i].answer) for c in group]
            for i, group in enumerate(completions)
        ]
        return [[g.reward for g in row] for row in rewards], {"env/all/reward/mine": 1.5}

    library = train_grpo(tiny(tmp_path / "library"))
    mine = train_grpo(tiny(tmp_path / "mine"), reward_fn=verifier_again)
    assert calls[0] == (4, 4, [4, 4, 4, 4]) and len(calls) == 6
    assert stop_reasons == {"stop", "length"}  # the sampler's reason comes with each completion (8 tokens cut some)
    for key in ("env/all/correct", "env/all/reward/total", "optim/loss", "test/pass_at_1"):
        assert mine.metrics[key].tolist() == pytest.approx(library.metrics[key].tolist(), nan_ok=True), key
    assert (mine.metrics["env/all/reward/mine"] == 1.5).all()

    # a reward that prefers shorter completions changes what is learned, but not the verifier's metrics' meaning
    def shorter(problems, prompts, completions):
        return torch.tensor([[-float(len(c)) for c in group] for group in completions])

    short = train_grpo(tiny(tmp_path / "short"), reward_fn=shorter)
    assert short.metrics["env/all/reward/total"].tolist() == pytest.approx(
        (-short.metrics["env/all/ac_tokens_per_turn"]).tolist()
    )


def _content_and_ok(renderer, tokens):
    message, ok = renderer.parse_response(tokens, tokens.stop_reason)
    return message["content"], ok


def test_a_bad_reward_fn_says_what_is_wrong(tmp_path):
    with pytest.raises(
        ValueError, match=r"shape \(4, 3\); it must return one per completion, shape \(problems, group_size\)"
    ):
        train_grpo(tiny(tmp_path, max_steps=1), reward_fn=lambda pr, p, c: torch.zeros(4, 3))
    with pytest.raises(ValueError, match="NaN or infinite"):
        train_grpo(tiny(tmp_path, max_steps=1), reward_fn=lambda pr, p, c: torch.full((4, 4), float("nan")))
    with pytest.raises(ValueError, match="pass one or the other"):
        train_grpo(tiny(tmp_path), step_fn=lambda *a: {}, reward_fn=lambda pr, p, c: torch.zeros(4, 4))


def test_a_lora_run_initialises_its_adapter_from_its_seed(tmp_path):
    # the adapter was drawn from whatever the global generator held, so two runs with one seed trained
    # different adapters (in two processes: step 0's grad norm 342 and 384)
    import torch

    from edurl.llm.loop import make_training_client

    def adapter(seed):
        trainer, _, _ = make_training_client(tiny(tmp_path, lora_rank=4, seed=seed))
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    first = adapter(0)
    torch.rand(7)  # the global generator moves on, as other work in the process would move it
    again, other = adapter(0), adapter(1)
    assert first.keys() == again.keys() and len(first) > 0
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not all(torch.equal(first[n], other[n]) for n in first)


def test_unscored_zero_advantage_datums_leave_the_run_as_it_was_but_the_metrics(tmp_path):
    """Issue 19: the recipe (score_zero_advantage=False) gives the datums of uniform groups no pass at all. Their
    gradient is 0 and their tokens stay in the denominator, so the run takes the same steps, to the last bit on
    one thread (the scored rows form the same sub-batch either way); only the metrics that read training
    log-probs change, to the datums with a gradient."""

    def half_uniform(problems, prompts, completions):  # even problems: one reward for all; odd: a token parity
        return torch.tensor([[float(i % 2 and sum(c) % 2) for c in group] for i, group in enumerate(completions)])

    kw = dict(max_steps=4, eval_every=4, batch_size=8)
    recipe = train_grpo(tiny(tmp_path / "a", **kw), reward_fn=half_uniform).metrics
    scored = train_grpo(tiny(tmp_path / "b", score_zero_advantage=True, **kw), reward_fn=half_uniform).metrics
    mixed = recipe["env/all/by_group/frac_mixed"]
    assert ((mixed > 0) & (mixed <= 0.5)).all(), "every step needs uniform and mixed groups"
    for column in ("optim/loss", "optim/grad_norm", "env/all/reward/total", "test/pass_at_1"):
        assert recipe[column].equals(scored[column]), column
    assert (recipe["optim/entropy"] != scored["optim/entropy"]).all()


# ---------------------------------------------------------------- a log_dir that already holds a run


def _earlier_run(tmp_path, **kw):
    config = tiny(tmp_path, max_steps=4, save_every=2, eval_every=4, **kw)
    train_grpo(config)
    return config


def test_a_fresh_run_into_an_earlier_runs_checkpoints_is_refused(tmp_path):
    # it used to overwrite the earlier run's metrics and leave its checkpoints, so that a later resume=True
    # loaded the earlier run's weights into this one (and its metrics held steps 0, 1, 4, 5)
    config = _earlier_run(tmp_path)
    before = (tmp_path / "run" / "metrics.jsonl").read_text(encoding="utf-8")
    with pytest.raises(
        ValueError, match=r"earlier run's checkpoints \(newest: step_000004\).*resume=True.*--overwrite"
    ):
        train_grpo(replace(config, learning_rate=0.0, max_steps=2))
    assert (tmp_path / "run" / "metrics.jsonl").read_text(encoding="utf-8") == before  # nothing lost
    with pytest.raises(ValueError, match="set one of them"):
        replace(config, resume=True, overwrite=True)
    again = train_grpo(replace(config, learning_rate=0.0, max_steps=2, save_every=0, overwrite=True))  # it replaces
    assert list(again.metrics["step"]) == [0, 1]
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))  # a later resume cannot load the old run
    with pytest.warns(UserWarning, match=r"earlier run's metrics.jsonl \(2 steps, no checkpoints\); this run replaces"):
        train_grpo(replace(config, max_steps=1, save_every=0))


def test_overwrite_beside_a_bad_setting_fails_with_the_earlier_run_still_there(tmp_path):
    """--overwrite deleted the earlier run's checkpoints and metrics first, so a misspelt device, a missing base
    model or zero threads beside it lost that run and then failed anyway."""
    config = _earlier_run(tmp_path)
    before = (tmp_path / "run" / "metrics.jsonl").read_text(encoding="utf-8")
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        train_grpo(replace(config, overwrite=True, device="gpu"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train_grpo(replace(config, overwrite=True, base_model=str(tmp_path / "no_such_model")))
    with pytest.raises(ValueError, match="num_threads must be a positive int or None, got 0"):
        replace(config, overwrite=True, num_threads=0)
    assert (tmp_path / "run" / "metrics.jsonl").read_text(encoding="utf-8") == before
    assert (
        sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
        == saved
        == ["step_000002", "step_000004"]
    )


def test_a_resume_whose_config_computes_something_else_is_refused(tmp_path):
    config = _earlier_run(tmp_path)
    with pytest.raises(ValueError, match=r"2 field\(s\).*loss_fn: 'importance_sampling' -> 'ppo'.*seed: 0 -> 7"):
        train_grpo(replace(config, resume=True, max_steps=6, loss_fn="ppo", seed=7))
    with pytest.raises(ValueError, match="at step 4, past max_steps=2"):
        train_grpo(replace(config, resume=True, max_steps=2))
    resumed = train_grpo(replace(config, resume=True, max_steps=6, eval_every=2, num_threads=2))  # these may change
    assert list(resumed.metrics["step"]) == list(range(6))


def test_a_resume_may_name_the_same_base_model_folder_another_way(tmp_path, qwen_dir, monkeypatch):
    """A LoRA run resumed with base_model spelt another way (through a symlink, or relative) was refused as a
    config that computes something else; and the same spelling naming another folder (a symlink since repointed)
    was accepted. The run's config.json now keeps the folder's real path, and that decides."""
    config = _earlier_run(tmp_path, base_model=str(qwen_dir), lora_rank=4)
    link = tmp_path / "model_link"
    link.symlink_to(qwen_dir, target_is_directory=True)
    resumed = train_grpo(replace(config, resume=True, max_steps=5, base_model=str(link)))
    assert list(resumed.metrics["step"]) == list(range(5))
    monkeypatch.chdir(qwen_dir.parent)
    resumed = train_grpo(replace(config, resume=True, max_steps=6, base_model=qwen_dir.name))
    assert list(resumed.metrics["step"]) == list(range(6))
    copy = shutil.copytree(qwen_dir, tmp_path / "model_copy")
    link.unlink()
    link.symlink_to(copy, target_is_directory=True)
    with pytest.raises(ValueError, match=r"1 field\(s\).*base_model_folder: .*qwen2-random.* -> .*model_copy"):
        train_grpo(replace(config, resume=True, max_steps=7, base_model=str(link)))
    (tmp_path / "second").mkdir()  # the run itself through the link, resumed through it after it moved
    through_link = _earlier_run(tmp_path / "second", base_model=str(link), lora_rank=4)
    link.unlink()
    link.symlink_to(qwen_dir, target_is_directory=True)
    with pytest.raises(ValueError, match=r"base_model_folder: .*model_copy.* -> .*qwen2-random"):
        train_grpo(replace(through_link, resume=True, max_steps=5))


def test_a_resume_with_nothing_to_resume_from_keeps_the_metrics(tmp_path):
    # it used to start over and overwrite metrics.jsonl (4 lines -> 1) with exit code 0
    config = tiny(tmp_path, max_steps=4, eval_every=4)
    train_grpo(config)
    with pytest.raises(
        ValueError, match=r"no checkpoint to resume from, only an earlier run's metrics.jsonl \(4 steps\)"
    ):
        train_grpo(replace(config, resume=True, max_steps=1))
    assert len(load_metrics(tmp_path / "run")) == 4
    # a run killed while it wrote its first checkpoint: the message said it saved none (save_every=0)
    cut = tmp_path / "run" / "checkpoints" / "step_000004"
    cut.mkdir(parents=True)
    (cut / "state.pt.tmp").write_bytes(b"half")
    with pytest.raises(ValueError, match=r"cut off while being written \(step_000004"):
        train_grpo(replace(config, resume=True, max_steps=1))
    fresh = train_grpo(replace(config, resume=True, max_steps=1, log_dir=str(tmp_path / "new")))  # an empty folder
    assert fresh.start is not None and len(fresh.metrics) == 1


def test_a_max_tokens_that_cuts_off_the_tasks_replies_is_named(tmp_path):
    # --max-tokens 9 (or 7-digit sums at the default 16) used to run to the end with every correct reply cut off
    # and graded 0, and nothing said why
    import warnings

    with pytest.warns(
        UserWarning,
        match=r"max_tokens=8 cuts off 256 of 256 of this task's reference replies .* up to 12 tokens.*max_tokens >= 12",
    ) as w:
        train_grpo(tiny(tmp_path / "short", max_steps=1))
    assert [r.filename for r in w if "cuts off" in str(r.message)] == [__file__]  # at the call, once
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train_grpo(tiny(tmp_path / "fits", max_steps=1, max_tokens=12))
    assert not [w for w in seen if "cuts off" in str(w.message)]


def test_a_log_dir_that_is_a_file_is_refused_before_any_work(tmp_path):
    (tmp_path / "run").write_text("notes", encoding="utf-8")  # it used to fail in mkdir, after the model was loaded
    with pytest.raises(ValueError, match="is a file; pass a folder"):
        train_grpo(tiny(tmp_path, max_steps=1))
    with pytest.raises(ValueError, match="lies under .*run', which is a file; pass a folder"):
        train_grpo(tiny(tmp_path / "run", max_steps=1))  # a NotADirectoryError from mkdir, after the model was built


def test_dro_beta_is_checked_when_the_config_is_built():
    """-1 and NaN failed only in the loss at the first step, and inf gave NaN losses that optim_step blamed on the
    log-probs or rewards."""
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="dro_beta must be a finite number >= 0"):
            GRPOConfig(loss_fn="dro", dro_beta=bad)
    assert GRPOConfig(loss_fn="dro", dro_beta=0.0).loss_fn_config() == {"beta": 0.0}


def test_a_resume_under_torchrun_of_a_run_without_sample_per_problem_says_where_it_resumes(tmp_path):
    """Under torchrun every rank samples per problem, so '--no-sample-per-problem' is overridden there: the advice
    'resume with that run's settings' could not be followed, and the refusal now says to resume in one process."""
    from edurl.llm.loop import _check_log_dir, _config_json

    earlier = tiny(tmp_path, sample_per_problem=False)
    log_dir = tmp_path / "run"
    (log_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (log_dir / "checkpoints" / "step_000002" / "state.pt").write_bytes(b"")
    (log_dir / "config.json").write_text(_config_json(earlier, "GRPO"), encoding="utf-8")
    with pytest.raises(ValueError, match="resumes only in one process"):
        _check_log_dir(replace(earlier, sample_per_problem=True, resume=True), log_dir, "GRPO")
    with pytest.raises(ValueError, match="that run's settings") as other:  # another difference: the plain advice
        _check_log_dir(replace(earlier, sample_per_problem=True, seed=5, resume=True), log_dir, "GRPO")
    assert "one process" not in str(other.value)
