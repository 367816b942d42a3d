"""Off-policy GRPO (edurl.llm.off_policy): batch s is sampled with the weights of step s - k, in a thread of its
own, in a process of its own or in turn, and the run repeats, resumes and fails cleanly."""

import pickle
import subprocess
import sys
import time
import types
from dataclasses import replace

import pandas as pd
import pytest
import torch

from edurl.llm.datum import build_datum
from edurl.llm.grpo import GRPOConfig, Rollout, train_grpo
from edurl.llm.loop import make_training_client, run_training_loop
from edurl.llm.off_policy import ProcessSampler, SamplerProcess, pack_rollout, unpack_rollout
from edurl.metrics import load_metrics

from .test_grpo import TINY_SFT, _cache, tiny  # noqa: F401  (_cache: the per-session warm-start cache)

WARM = replace(TINY_SFT, max_steps=150)  # enough SFT that the rewards differ within groups


def run(tmp_path, name, **kw):
    return train_grpo(tiny(tmp_path / name, **{"sft": WARM, "max_steps": 8, "max_tokens": 14, **kw})).metrics


def same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    cols = [c for c in a.columns if not c.startswith("time")]
    pd.testing.assert_frame_equal(a[cols], b[cols], check_exact=True)


def test_zero_steps_off_policy_is_the_synchronous_loop(tmp_path):
    sync = run(tmp_path, "sync")
    k0 = run(tmp_path, "k0", max_steps_off_policy=0)
    assert sync["optim/grad_norm"].gt(0).all()
    assert list(k0["async/staleness"]) == [0.0] * 8
    same(sync, k0.drop(columns=["async/staleness"]))


def test_a_sampler_further_behind_than_the_run_is_the_stale_sampler(tmp_path):
    # every batch sampled with the starting weights: what refresh_sampler=False does by keeping the first sampler
    stale = run(tmp_path, "stale", refresh_sampler=False)
    with pytest.warns(UserWarning, match="keeps a copy of the trainable weights for every step") as record:
        lagged = run(tmp_path, "lagged", max_steps_off_policy=100)
    assert record[0].filename == __file__
    assert list(lagged["async/staleness"]) == [float(s) for s in range(8)]
    same(stale, lagged.drop(columns=["async/staleness"]))


def test_the_sampler_thread_gives_the_batches_of_the_sequential_run(tmp_path):
    threaded = run(tmp_path, "threaded", max_steps_off_policy=2)
    in_turn = run(tmp_path, "in_turn", max_steps_off_policy=2, concurrent_sampler=False)
    same(threaded, in_turn)
    assert list(threaded["async/staleness"]) == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    # stale batches move the ratio off 1: the clip binds and the sampler-trainer KL is no longer ~0
    assert threaded["optim/clip_fraction"].iloc[0] == 0.0
    assert threaded["optim/clip_fraction"].iloc[2:].gt(0).all()
    assert threaded["optim/kl_sample_train_v2"].iloc[2:].min() > 1e3 * threaded["optim/kl_sample_train_v2"].iloc[0]


def test_off_policy_run_resumes_exactly(tmp_path):
    whole = run(tmp_path, "whole", max_steps_off_policy=2, save_every=4)
    run(tmp_path, "resumed", max_steps_off_policy=2, save_every=4, max_steps=4)
    resumed = run(tmp_path, "resumed", max_steps_off_policy=2, save_every=4, resume=True)
    assert list(resumed["step"]) == list(range(8))
    # the interrupted run also evaluated at its last step (3); every other number is the same
    same(whole.drop(columns=["test/pass_at_1", "test/format"]), resumed.drop(columns=["test/pass_at_1", "test/format"]))
    with pytest.raises(ValueError, match="weights of steps 2 to 5"):  # saved at step 8 with k = 2 (6, 7); k = 6
        run(tmp_path, "resumed", max_steps_off_policy=6, save_every=4, max_steps=12, resume=True)


def test_a_refused_resume_leaves_the_metrics_as_they_were(tmp_path):
    # the refusal came after the resume had cut metrics.jsonl back to the checkpoint's step, losing steps 4 and 5
    run(tmp_path, "cut", max_steps_off_policy=2, save_every=4, max_steps=6)
    with pytest.raises(ValueError, match="weights of steps 0 to 1"):  # saved at step 4 with k = 2 (2, 3); k = 6
        run(tmp_path, "cut", max_steps_off_policy=6, save_every=4, resume=True)
    assert list(load_metrics(tmp_path / "cut" / "run")["step"]) == list(range(6))


def test_a_lora_off_policy_checkpoint_keeps_the_adapters_and_resumes_exactly(tmp_path):
    """A LoRA snapshot shares the trainer's frozen base, so a checkpoint keeps the stale samplers' adapters only (it
    kept k copies of the whole model), and a resume writes nothing into the shared base."""
    lora = dict(lora_rank=4, max_steps_off_policy=2, save_every=4)
    whole = run(tmp_path, "whole", **lora)
    run(tmp_path, "resumed", **lora, max_steps=4)
    state = torch.load(tmp_path / "resumed" / "run" / "checkpoints" / "step_000004" / "state.pt", weights_only=False)
    kept = state["extra"]["snapshots"]
    assert sorted(kept) == [2, 3]
    assert all(weights and all("lora_" in name for name in weights) for weights in kept.values())
    resumed = run(tmp_path, "resumed", **lora, resume=True)
    cols = ["test/pass_at_1", "test/format"]
    same(whole.drop(columns=cols), resumed.drop(columns=cols))


@pytest.mark.cuda
def test_a_lora_run_with_the_sampler_in_a_process_on_cuda(tmp_path):
    """ProcessSampler moves its first snapshot to the CPU to send it; with a LoRA snapshot sharing the trainer's base,
    that must not move the trainer's base off the GPU (it did, in a first version of the shared base)."""
    m = run(tmp_path, "lora_process", lora_rank=4, max_steps_off_policy=1, sampler_process=True, device="cuda")
    assert len(m) == 8 and m["optim/grad_norm"].notna().all()


def test_an_error_in_the_sampler_thread_reaches_the_caller(tmp_path):
    def reward_fn(problems, prompts, completions):
        raise ValueError("the grader broke")

    with pytest.raises(RuntimeError, match="sampler thread failed") as info:
        train_grpo(tiny(tmp_path / "broken", sft=WARM, max_steps_off_policy=1), reward_fn=reward_fn)
    assert "the grader broke" in str(info.value.__cause__)


def test_off_policy_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="int >= 0"):
        GRPOConfig(max_steps_off_policy=-1)
    with pytest.raises(ValueError, match="int >= 0"):  # True was taken as k = 1
        GRPOConfig(max_steps_off_policy=True)
    with pytest.raises(ValueError, match="set one of them"):
        GRPOConfig(max_steps_off_policy=1, refresh_sampler=False)
    with pytest.raises(ValueError, match="needs max_steps_off_policy set"):
        GRPOConfig(sampler_process=True)
    with pytest.raises(ValueError, match="concurrent_sampler=True"):
        GRPOConfig(max_steps_off_policy=1, sampler_process=True, concurrent_sampler=False)
    with pytest.raises(ValueError, match="step_fn"):
        train_grpo(tiny(tmp_path, max_steps_off_policy=1), step_fn=lambda *a: {})


def test_the_sampler_process_gives_the_batches_of_the_sequential_run(tmp_path):
    in_turn = run(tmp_path, "in_turn", max_steps_off_policy=1, concurrent_sampler=False)
    process = run(tmp_path, "process", max_steps_off_policy=1, sampler_process=True)
    same(process, in_turn)
    assert list(process["async/staleness"]) == [0.0] + [1.0] * 7
    # its start-up is logged once, with the first step, and kept out of time/step
    assert process["time/sampler_start"].notna().tolist() == [True] + [False] * 7
    assert process["time/sampler_start"].iloc[0] > 0


def test_the_sampler_process_stays_until_the_trainer_stops_it(tmp_path):
    # it once exited right after queueing the last batch, and a batch large enough was lost on the way
    trainer, renderer, task = make_training_client(tiny(tmp_path, sft=WARM))
    config = tiny(tmp_path, sft=WARM, max_steps=2, max_steps_off_policy=1, sampler_process=True)
    sampler = ProcessSampler(config, trainer, renderer, task)
    try:
        for step in range(2):
            rollout, _ = sampler.next(step)
            assert rollout.step == step and rollout.datums
            sampler.publish(step + 1)
        time.sleep(1.5)
        assert sampler.process.process.is_alive()
    finally:
        sampler.close()
    assert sampler.process.process.exitcode == 0


def reward_with_the_thread_count(problems, prompts, completions):  # module level, so that it pickles
    return torch.zeros(len(completions), len(completions[0])), {"sampler_threads": torch.get_num_threads()}


def test_the_sampler_process_honours_the_thread_cap(tmp_path, monkeypatch):
    # it once called torch.set_num_threads(config.num_threads) itself, past $EDURL_MAX_THREADS (make test sets it)
    monkeypatch.setenv("EDURL_MAX_THREADS", "1")
    trainer, renderer, task = make_training_client(tiny(tmp_path, sft=WARM))
    config = tiny(tmp_path, sft=WARM, max_steps=1, max_steps_off_policy=1, sampler_process=True, num_threads=2)
    sampler = ProcessSampler(config, trainer, renderer, task, reward_with_the_thread_count)
    try:
        rollout, _ = sampler.next(0)
    finally:
        sampler.close()
    assert rollout.row["sampler_threads"] == 1


def test_the_sampler_process_takes_num_threads_none(tmp_path):
    # GRPOConfig allows None (leave torch's setting alone), and the process once crashed on cpu_threads(None)
    trainer, renderer, task = make_training_client(tiny(tmp_path, sft=WARM))
    config = tiny(tmp_path, sft=WARM, max_steps=1, max_steps_off_policy=1, sampler_process=True, num_threads=None)
    sampler = ProcessSampler(config, trainer, renderer, task, reward_with_the_thread_count)
    try:
        rollout, _ = sampler.next(0)
    finally:
        sampler.close()
    assert rollout.step == 0 and rollout.row["sampler_threads"] >= 1


def _fail_to_load():
    raise ValueError("this task cannot be rebuilt in another process")


class TaskThatWillNotLoad:  # pickles, but fails to unpickle in the sampler process
    def __reduce__(self):
        return (_fail_to_load, ())


def test_a_sampler_process_that_fails_to_start_is_stopped(tmp_path):
    trainer, renderer, _ = make_training_client(tiny(tmp_path, sft=WARM))
    config = tiny(tmp_path, sft=WARM, max_steps_off_policy=1, sampler_process=True)
    process = SamplerProcess()
    with pytest.raises(RuntimeError, match="failed while starting") as info:
        ProcessSampler(config, trainer, renderer, TaskThatWillNotLoad(), process=process)
    assert "this task cannot be rebuilt in another process" in str(info.value)
    assert not process.process.is_alive()  # closed, not left waiting for a stop


def test_a_process_sampled_run_resumes_exactly(tmp_path):
    whole = run(tmp_path, "whole", max_steps_off_policy=2, save_every=4)
    run(tmp_path, "resumed", max_steps_off_policy=2, save_every=4, max_steps=4, sampler_process=True)
    resumed = run(tmp_path, "resumed", max_steps_off_policy=2, save_every=4, resume=True, sampler_process=True)
    assert list(resumed["step"]) == list(range(8))
    drop = ["test/pass_at_1", "test/format", "time/sampler_start"]
    same(whole.drop(columns=["test/pass_at_1", "test/format"]), resumed.drop(columns=drop))
    with pytest.raises(ValueError, match="weights of steps 2 to 5"):  # the same check as the thread sampler's
        run(tmp_path, "resumed", max_steps_off_policy=6, save_every=4, max_steps=12, resume=True, sampler_process=True)


def grader_that_breaks(problems, prompts, completions):  # module level, so that it pickles
    raise ValueError("the grader broke")


def test_an_error_in_the_sampler_process_reaches_the_caller(tmp_path):
    with pytest.raises(RuntimeError, match="sampler process failed while sampling for step 0") as info:
        train_grpo(
            tiny(tmp_path / "broken", sft=WARM, max_steps_off_policy=1, sampler_process=True),
            reward_fn=grader_that_breaks,
        )
    assert "ValueError: the grader broke" in str(info.value)  # the process's traceback


def test_the_sampler_process_refuses_what_does_not_pickle(tmp_path, monkeypatch):
    # before the warm start: make_training_client is not reached (it was, and the refusal came after the first
    # evaluation)
    monkeypatch.setitem(run_training_loop.__globals__, "make_training_client", lambda config: 1 / 0)
    with pytest.raises(TypeError, match="define a reward_fn at module level"):
        train_grpo(
            tiny(tmp_path / "lambda", sft=WARM, max_steps_off_policy=1, sampler_process=True),
            reward_fn=lambda problems, prompts, completions: None,
        )


class RewardThatWillNotLoad:  # pickles here, fails to unpickle in the sampler process
    def __call__(self, problems, prompts, completions):
        return None

    def __reduce__(self):
        return (_fail_to_load, ())


def test_overwrite_keeps_the_earlier_run_when_the_sampler_process_fails_to_start(tmp_path):
    # overwrite=True deleted the earlier run's checkpoints and metrics before the sampler process started
    train_grpo(tiny(tmp_path, sft=WARM, max_steps=4, save_every=2))
    with pytest.raises(RuntimeError, match="failed while starting"):
        train_grpo(
            tiny(tmp_path, sft=WARM, max_steps=4, overwrite=True, max_steps_off_policy=1, sampler_process=True),
            reward_fn=RewardThatWillNotLoad(),
        )
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert len(load_metrics(tmp_path / "run")) == 4


def notebook_reward(problems, prompts, completions):  # becomes a notebook cell's function in the test below
    return None


class NotebookTask:  # becomes a class of a notebook cell in the test below
    pass


@pytest.mark.parametrize("sent", ["reward_fn", "task"])
def test_the_sampler_process_refuses_what_a_notebook_defines(tmp_path, monkeypatch, sent):
    # A notebook's __main__ has no __file__; its functions pickle by name (__main__.notebook_reward), and only the
    # spawned process would fail, to import them, as "failed while starting". It is refused before it is sent.
    main = types.ModuleType("__main__")
    monkeypatch.setattr(notebook_reward, "__module__", "__main__")
    monkeypatch.setattr(NotebookTask, "__module__", "__main__")
    main.notebook_reward, main.NotebookTask = notebook_reward, NotebookTask  # so that pickle.dumps finds them
    trainer, renderer, task = make_training_client(tiny(tmp_path, sft=WARM))
    config = tiny(tmp_path, sft=WARM, max_steps_off_policy=1, sampler_process=True)
    monkeypatch.setitem(sys.modules, "__main__", main)
    reward_fn, task = (notebook_reward, task) if sent == "reward_fn" else (None, NotebookTask())
    name = "function notebook_reward" if sent == "reward_fn" else "class NotebookTask"
    with pytest.raises(TypeError, match=f"the {name} is defined in a notebook cell") as info:
        ProcessSampler(config, trainer, renderer, task, reward_fn)
    assert "put it in a .py file next to the notebook" in str(info.value)
    assert "sampler_process=False" in str(info.value)


def test_a_script_without_a_main_guard_is_told_what_to_do(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from edurl.llm.off_policy import SamplerProcess\n"
        "p = SamplerProcess()\n"  # spawn imports this file again in the new process, which starts one again
        "p.process.join(120)\n"
        "print('exit code', p.process.exitcode)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "exit code 1" in done.stdout
    assert 'if __name__ == "__main__":' in done.stderr


def test_a_reward_fn_defined_under_the_main_guard_is_named(tmp_path):
    # the process failed with AttributeError: Can't get attribute 'my_reward' on <module '__mp_main__'>, no more
    script = tmp_path / "inside_guard.py"
    script.write_text(
        "from edurl.llm.off_policy import SamplerProcess, spawn_payload\n"
        'if __name__ == "__main__":\n'
        "    def my_reward(problems, prompts, completions):\n"
        "        return None\n"
        "    p = SamplerProcess()\n"
        '    p.weights.put(("setup", spawn_payload(my_reward)))\n'
        "    kind, body = p.batches.get(timeout=240)\n"
        "    print(kind, body)\n"
        "    p.close()\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.stdout.startswith("error") and "my_reward" in done.stdout, done.stderr
    assert "Define it at the top level of the script, above the guard" in done.stdout


def test_packed_rollouts_come_back_equal():
    datums = [
        build_datum([1, 2, 3], [4, 5], [-0.5, -0.25], 1.5),
        build_datum([7], [8, 9, 10], [-1.0, -2.0, -3.0], -0.5),
    ]
    rollout = Rollout(step=3, datums=datums, row={"env/all/correct": 0.5}, sampler_version=2)
    back = unpack_rollout(pickle.loads(pickle.dumps(pack_rollout(rollout))))
    assert (back.step, back.row, back.sampler_version) == (3, {"env/all/correct": 0.5}, 2)
    assert [d.model_input for d in back.datums] == [d.model_input for d in datums]
    for a, b in zip(back.datums, datums):
        assert list(a.loss_fn_inputs) == list(b.loss_fn_inputs)
        for key in b.loss_fn_inputs:
            assert a.loss_fn_inputs[key].dtype == b.loss_fn_inputs[key].dtype
            assert torch.equal(a.loss_fn_inputs[key], b.loss_fn_inputs[key])
    empty = unpack_rollout(pack_rollout(Rollout(step=0, datums=[], row={})))
    assert empty.datums == []
