"""Exercise 10.3, a whole offline DRO step: the checker passes the library's step and the worked solution, and
names each realistic mistake from its effect."""

import pytest
import torch

from edurl import llm
from edurl.exercises import ch10
from edurl.exercises._core import FAILED, NOT_ATTEMPTED, PASSED
from edurl.exercises.solutions import ch10 as solutions
from edurl.llm.grpo import GRPOConfig
from edurl.llm.offline import draw_groups

from .conftest import WARM, assert_gives_nothing_away


def check(fn, base):
    return ch10._compare_offline_steps(fn, base=base, config=GRPOConfig(sft=WARM, **ch10.OFFLINE_CHECK))


def buggy_step(bug: str):
    """The worked solution with one realistic mistake."""

    def step_fn(config, trainer, buffer, step):
        if bug == "samples":
            trainer.save_weights_and_get_sampling_client("fresh")
        seed = step if bug == "unseeded draw" else config.seed
        drawn = draw_groups(buffer, config.batch_size, seed, step if bug != "unseeded draw" else 1000 + step)
        rewards = torch.tensor([buffer.rewards[i] for i in drawn])
        if bug == "soft advantages":
            adv = solutions.soft_advantages(rewards, config.dro_beta)
        elif bug == "batch mean":
            adv = rewards - rewards.mean()
        else:
            adv = rewards - rewards.mean(dim=1, keepdim=True)
        datums = []
        for n, i in enumerate(drawn):
            for j, (completion, logprobs) in enumerate(zip(buffer.completions[i], buffer.logprobs[i])):
                if bug == "own logprobs":
                    logprobs = [0.0] * len(logprobs)
                datums.append(llm.build_datum(buffer.prompts[i], completion, logprobs, float(adv[n, j])))
        loss_fn = "importance_sampling" if bug == "wrong loss" else config.loss_fn
        loss_config = {} if bug in ("wrong loss", "no beta") else config.loss_fn_config()
        if bug == "no beta":
            loss_config = {"beta": 0.05}
        kwargs = dict(aggregation=config.aggregation, max_tokens=config.max_tokens, temperature=config.temperature)
        if bug == "no temperature":  # scored at the default 1.0; the buffer was sampled at config.temperature
            del kwargs["temperature"]
        out = trainer.forward_backward(datums, loss_fn, loss_config, **kwargs).result()
        if bug != "no update":
            trainer.optim_step(llm.AdamParams(learning_rate=config.learning_rate)).result()
        if bug == "optim_step twice":
            trainer.optim_step(llm.AdamParams(learning_rate=config.learning_rate)).result()
        return {"optim/loss": out.loss}

    return step_fn


@pytest.mark.parametrize("fn", [ch10._reference_offline_step, solutions.offline_step])
def test_offline_step_checker_passes(fn, base):
    verdict = check(fn, base)
    assert verdict.status == PASSED, verdict.message
    assert verdict.implementation is fn


@pytest.mark.parametrize(
    "bug, message",
    [
        ("samples", "the step sampled from the model"),
        ("unseeded draw", "not this step's groups"),
        ("soft advantages", "the advantages are DRO's soft ones"),
        ("batch mean", "the mean over the whole batch"),
        ("own logprobs", "not the logged ones"),
        ("wrong loss", "forward_backward was called with loss_fn='importance_sampling'"),
        ("no beta", "loss_fn_config={'beta': 0.05}"),
        ("no update", "the weights never changed"),
        ("optim_step twice", "2 optimizer steps in one step; take exactly one"),
        ("no temperature", "temperature='its default'"),
    ],
)
def test_offline_step_checker_names_the_mistake(bug, message, base):
    verdict = check(buggy_step(bug), base)
    assert verdict.status == FAILED
    assert message in verdict.message, verdict.message
    verdict.hints = ch10.check_offline_step.hints
    assert_gives_nothing_away(verdict)


def test_offline_step_not_attempted_and_the_run_uses_the_learners_step(base, tmp_path, monkeypatch):
    def todo(config, trainer, buffer, step):
        raise NotImplementedError

    assert check(todo, base).status == NOT_ATTEMPTED
    calls = []

    def mine(config, trainer, buffer, step):
        calls.append(step)
        return solutions.offline_step(config, trainer, buffer, step)

    from edurl.llm.offline import train_offline

    config, (trainer, _), buffer = ch10._offline_setup(base, GRPOConfig(sft=WARM, **ch10.OFFLINE_CHECK))
    monkeypatch.setattr("edurl.llm.loop.make_training_client", lambda c: (trainer._trainer, *ch10_renderer_task(base)))
    result = train_offline(
        GRPOConfig(sft=WARM, **{**ch10.OFFLINE_CHECK, "eval_every": 2, "num_eval": 4}, log_dir=str(tmp_path)),
        buffer,
        step_fn=mine,
    )
    assert calls == [0, 1] and list(result.metrics["step"]) == [0, 1]


def ch10_renderer_task(base):
    from edurl.llm.renderer import ChatMLRenderer

    return ChatMLRenderer(base[1]), WARM.task()
