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
        seed = {"unseeded draw": step, "seed 0": 0}.get(bug, config.seed)
        drawn = draw_groups(buffer, config.batch_size, seed, step if bug != "unseeded draw" else 1000 + step)
        if bug == "centred in the buffer":  # the buffer's own rewards centred: it passed, as its advantages are right
            for i in drawn:
                mean = sum(buffer.rewards[i]) / len(buffer.rewards[i])
                buffer.rewards[i] = [r - mean for r in buffer.rewards[i]]
        rewards = torch.tensor([buffer.correct[i] if bug == "correctness" else buffer.rewards[i] for i in drawn])
        if bug == "soft advantages":
            adv = solutions.soft_advantages(rewards, config.dro_beta)
        elif bug == "batch mean":
            adv = rewards - rewards.mean()
        elif bug == "sign flipped":
            adv = rewards.mean(dim=1, keepdim=True) - rewards
        elif bug == "mean over groups":
            adv = rewards - rewards.mean(dim=0, keepdim=True)
        elif bug == "std":
            adv = (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + 1e-6)
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
        if bug == "beta written in":  # the first checked step's beta, and not the second's
            loss_config = {"beta": 0.5}
        kwargs = dict(aggregation=config.aggregation, max_tokens=config.max_tokens, temperature=config.temperature)
        if bug == "no temperature":  # scored at the default 1.0; the buffer was sampled at config.temperature
            del kwargs["temperature"]
        out = trainer.forward_backward(datums, loss_fn, loss_config, **kwargs).result()
        if bug == "forward_backward twice":  # once more "to read the loss"
            out = trainer.forward_backward(datums, loss_fn, loss_config, **kwargs).result()
        lr = 1e-3 if bug == "lr written in" else config.learning_rate  # the first checked step's, not the second's
        if bug != "no update":
            trainer.optim_step(llm.AdamParams(learning_rate=lr)).result()
        if bug == "optim_step twice":
            trainer.optim_step(llm.AdamParams(learning_rate=lr)).result()
        if bug == "each group once":  # the drawn groups deleted: once blamed on the advantages, which are right
            for name in ("prompts", "completions", "logprobs", "rewards", "correct", "source"):
                for i in sorted(drawn, reverse=True):
                    del getattr(buffer, name)[i]
        if bug == "loss only":  # the notebook reads optim/kl_sample_train_v2 from the rows
            return {"optim/loss": out.loss}
        if bug == "a tensor in the row":
            return {**out.metrics, "buffer/group_reward": rewards.mean(1)}
        return {**out.metrics, "optim/loss": out.loss}

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
        # these three got "the advantages differ from each drawn group's logged rewards minus the group's mean"
        ("sign flipped", "the sign is flipped"),
        ("mean over groups", "the mean over the drawn groups (dim=0)"),
        ("std", "divided by each group's std"),
        ("own logprobs", "not the logged ones"),
        ("wrong loss", "forward_backward was called with loss_fn='importance_sampling'"),
        ("no beta", "loss_fn_config={'beta': 0.05}"),
        ("no update", "the weights never changed"),
        ("optim_step twice", "2 optimizer steps in one step; take exactly one"),
        ("no temperature", "temperature='its default'"),
        # each passed before: the checked config had every reward equal to its correctness, one lr and beta for both
        # steps (the ones written in here), and seed 0, the default
        ("correctness", "the advantages come from the correctness"),
        ("beta written in", "forward_backward was called with loss_fn_config={'beta': 0.5} where the config asks for"),
        ("lr written in", "step 2: optim_step ran with learning rate 0.001"),
        ("seed 0", "step 1: your datums are not this step's groups. Draw"),
        ("forward_backward twice", "forward_backward ran 2 times on the step's datums"),
        ("loss only", "lacks 'optim/kl_sample_train_v2', which the notebook reads"),
        ("a tensor in the row", "metric 'buffer/group_reward' is a tensor of shape (4,)"),
        ("centred in the buffer", "your step changed the buffer it trains on (group"),
        ("each group once", "your step changed the buffer it trains on (its prompts went from 12 groups to 8)"),
    ],
)
def test_offline_step_checker_names_the_mistake(bug, message, base):
    verdict = check(buggy_step(bug), base)
    assert verdict.status == FAILED
    assert message in verdict.message, verdict.message
    verdict.hints = ch10.check_offline_step.hints
    assert_gives_nothing_away(verdict)


def test_the_checked_draws_hold_replies_that_max_tokens_cuts_off():
    """Chapter 6's checkpoint boxes every answer, so without cut-off replies its rewards equal its correctness, and a
    step that took advantages from the correctness passed. Which problems the checked steps draw does not depend on
    the model (collect_buffer's problems and draw_groups are seeded): each step must draw some whose reference reply
    is longer than max_tokens."""
    from edurl.llm.sft import reply_lengths

    config = GRPOConfig(**ch10.OFFLINE_CHECK)
    renderer, task = llm.ChatMLRenderer(llm.build_char_tokenizer()), config.sft.task()
    problems = task.sample(12, split="train", seed=llm.problem_seed(10, 1_000_000))  # _offline_setup's buffer
    lengths = reply_lengths(renderer, problems)
    for step in range(config.max_steps):
        drawn = [lengths[i] for i in torch.randperm(12, generator=torch.Generator().manual_seed(
            llm.problem_seed(config.seed, step)))[: config.batch_size].tolist()]  # fmt: skip
        assert sum(n > config.max_tokens for n in drawn) >= 1, drawn


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
        # max_tokens as the notebook runs it: the checked steps' 11 cuts off replies on purpose, and the loop warns so
        GRPOConfig(
            sft=WARM, **{**ch10.OFFLINE_CHECK, "eval_every": 2, "num_eval": 4, "max_tokens": 16}, log_dir=str(tmp_path)
        ),
        buffer,
        step_fn=mine,
    )
    assert calls == [0, 1] and list(result.metrics["step"]) == [0, 1]
    # the notebook reads it after training with the learner's step (the worked solution's row lacked it)
    assert result.metrics["optim/kl_sample_train_v2"].notna().all()


def ch10_renderer_task(base):
    from edurl.llm.renderer import ChatMLRenderer

    return ChatMLRenderer(base[1]), WARM.task()


def test_a_buffer_changed_to_hold_arrays_is_named_not_a_crash():
    """An array written into the buffer's lists made the comparison itself raise ("truth value of an array is
    ambiguous") out of the checker."""
    import copy

    import numpy as np

    from edurl.llm.offline import RolloutBuffer

    before = RolloutBuffer(
        prompts=[[1, 2], [1, 3]], completions=[[[3], [4]], [[5], [6]]], logprobs=[[[-0.1], [-0.2]]] * 2,
        rewards=[[1.0, 0.0], [0.0, 0.0]], correct=[[1.0, 0.0], [0.0, 0.0]], source=["sft", "sft"], temperature=1.0,
    )  # fmt: skip
    assert ch10._changed_buffer(copy.deepcopy(before), before, 1) is None
    group = copy.deepcopy(before)
    group.rewards[1] = np.asarray(group.rewards[1]) - 0.0  # the same values, as an array
    assert "group 1's rewards changed" in ch10._changed_buffer(group, before, 1)
    whole = copy.deepcopy(before)
    whole.rewards = np.asarray(whole.rewards)
    assert "(its rewards changed)" in ch10._changed_buffer(whole, before, 1)
