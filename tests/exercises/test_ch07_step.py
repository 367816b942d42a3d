"""Exercise 7.4, the capstone: the grpo_step checker passes the library's step and the worked solution, and names
each realistic mistake from its effect."""

import pytest
import torch

from edurl import llm
from edurl.exercises import ch07
from edurl.exercises._core import FAILED, NOT_ATTEMPTED, PASSED
from edurl.exercises.ch06 import datum_shifted_by_prompt_length, datum_with_unmasked_prompt
from edurl.exercises.solutions import ch07 as solutions
from edurl.llm.clients import AdamParams
from edurl.llm.grpo import GRPOConfig

from .conftest import WARM, assert_gives_nothing_away


def check(fn, base):
    return ch07._compare_steps(fn, base=base, config=GRPOConfig(sft=WARM, **ch07.STEP_CHECK))


def buggy_step(bug: str):
    """The worked solution with one realistic mistake."""
    kept = {}

    def step_fn(config, trainer, renderer, task, step):
        seed = llm.problem_seed(config.seed, step)
        if bug == "stale sampler":
            kept.setdefault("sampler", trainer.save_weights_and_get_sampling_client("once"))
            sampler = kept["sampler"]
        else:
            sampler = trainer.save_weights_and_get_sampling_client(f"step_{step}")
        problems = task.sample(config.batch_size, split="train", seed=step if bug == "seed" else seed)
        prompts = [renderer.build_generation_prompt(p.messages()) for p in problems]
        params = llm.SamplingParams(
            max_tokens=config.max_tokens, temperature=config.temperature, stop=renderer.get_stop_sequences(), seed=seed
        )
        if bug == "one call per prompt":
            responses = [sampler.sample(p, config.group_size, params).result() for p in prompts]
        else:
            responses = sampler.sample_batch(prompts, config.group_size, params)
        flat = []  # (reward, correct) of each completion
        if bug == "mixed groups":  # sample-major order, then viewed as (P, G)
            for j in range(config.group_size):
                for problem, response in zip(problems, responses):
                    message, ok = renderer.parse_response(response.sequences[j].tokens)
                    g = llm.grade(message["content"], problem.answer, complete=ok)
                    flat.append((g.reward, float(g.correct)))
        else:
            for problem, response in zip(problems, responses):
                for seq in response.sequences:
                    message, ok = renderer.parse_response(seq.tokens)
                    if bug == "graded as complete":  # complete= left out: a cut-off reply keeps its format term
                        ok = True
                    g = llm.grade(message["content"], problem.answer, complete=ok)
                    reward = float(g.correct) if bug == "reward is correct" else g.reward  # the format term dropped
                    flat.append((reward, float(g.correct)))
        rewards = torch.tensor([r for r, _ in flat]).view(config.batch_size, config.group_size)
        correct = torch.tensor([c for _, c in flat]).view(config.batch_size, config.group_size)
        if bug == "uncentred":
            advantages = rewards.clone()
        elif bug == "batch mean":
            advantages = rewards - rewards.mean()
        elif bug == "sign flipped":
            advantages = rewards.mean(1, keepdim=True) - rewards
        elif bug == "mean over problems":
            advantages = rewards - rewards.mean(0, keepdim=True)
        elif bug == "std":
            advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
        else:
            advantages = solutions.group_advantages(rewards)
        one = {"unmasked prompt": datum_with_unmasked_prompt, "off by one": datum_shifted_by_prompt_length}.get(
            bug, llm.build_datum
        )
        datums = [
            one(prompt, seq.tokens, seq.logprobs, float(a))
            for prompt, response, group in zip(prompts, responses, advantages)
            for seq, a in zip(response.sequences, group)
        ]
        if bug == "reversed datums":
            datums = datums[::-1]
        kwargs = dict(aggregation=config.aggregation, max_tokens=config.max_tokens, temperature=config.temperature)
        loss_fn = config.loss_fn
        if bug == "library defaults":  # the notebook's section 1 values, copied in: right for the default run only
            loss_fn, kwargs = "importance_sampling", dict(kwargs, aggregation="token_mean", max_tokens=16)
        if bug == "aggregation":
            del kwargs["aggregation"]
        if bug == "no temperature":  # scored at the default 1.0, sampled at config.temperature
            del kwargs["temperature"]
        if bug in ("one forward_backward per group", "optim_step per group"):
            G = config.group_size
            for k in range(0, len(datums), G):
                trainer.forward_backward(datums[k : k + G], loss_fn, config.loss_fn_config(), **kwargs)
                if bug == "optim_step per group":  # one update per problem, not one per batch
                    trainer.optim_step(AdamParams(config.learning_rate)).result()
        elif bug != "no forward_backward":
            trainer.forward_backward(datums, loss_fn, config.loss_fn_config(), **kwargs).result()
        if bug not in ("no optim_step", "optim_step per group"):
            trainer.optim_step(AdamParams() if bug == "default lr" else AdamParams(config.learning_rate)).result()
        if bug == "optim_step twice":  # a second step on no new gradient (the client cleared it after the first)
            metrics = trainer.optim_step(AdamParams(config.learning_rate)).result()
            assert set(metrics) == {"optim/grad_norm", "optim/lr"}  # code that reads them gets the hint, not a crash
        if bug == "no return":
            return None
        row = {"env/all/reward/total": float(rewards.mean()), "env/all/correct": float(correct.mean())}
        if bug == "a tensor in the row":  # train_grpo's logger refused it in the training cell, after a pass here
            row["env/all/reward/by_problem"] = rewards.mean(1)
        return row

    return step_fn


def test_passes_the_library_step_the_solution_and_a_reordered_batch(base):
    for fn in (ch07._reference_grpo_step, solutions.grpo_step, buggy_step("none"), buggy_step("reversed datums")):
        verdict = check(fn, base)
        assert verdict.status == PASSED, verdict.message
        assert verdict.implementation is fn


def test_the_checked_batch_has_mixed_and_uniform_groups(base):
    """Without both, uncentred rewards or a group laid out across problems could pass unseen."""
    config, (trainer, _), renderer, task = ch07._step_setup(base, GRPOConfig(sft=WARM, **ch07.STEP_CHECK))
    log = trainer.begin_step()
    row = ch07._reference_grpo_step(config, trainer, renderer, task, 0)
    rewards, correct, _ = ch07._rewards(log, config, renderer, task, 0)
    uniform = rewards.max(1).values == rewards.min(1).values
    assert uniform.any() and not uniform.all(), rewards
    assert not torch.equal(rewards, correct), rewards  # a reply without its box: rewards that are correctness pass not
    assert row["env/all/by_group/frac_mixed"] == float((~uniform).float().mean())


def test_the_checked_problems_have_replies_that_max_tokens_cuts_off():
    """Chapter 6's checkpoint boxes every answer, so without cut-off replies its rewards equal its correctness, and a
    step that took advantages from the correctness passed the notebook's check. Which problems a step draws does not
    depend on the model: each checked step must hold some whose reference reply is longer than max_tokens."""
    from edurl.llm.sft import reply_lengths

    config = GRPOConfig(**ch07.STEP_CHECK)
    renderer, task = llm.ChatMLRenderer(llm.build_char_tokenizer()), config.sft.task()
    for step in range(config.max_steps):
        problems = task.sample(config.batch_size, split="train", seed=llm.problem_seed(config.seed, step))
        lengths = reply_lengths(renderer, problems)
        assert sum(n > config.max_tokens for n in lengths) >= 2, lengths
        assert sum(n <= config.max_tokens for n in lengths) >= 2, lengths


@pytest.mark.parametrize(
    "bug, message",
    [
        ("stale sampler", "a stale sampler"),
        ("uncentred", "raw rewards (uncentred)"),
        ("unmasked prompt", "the prompt is not masked"),
        ("off by one", "off by one"),
        ("mixed groups", "a group mixed completions of different problems"),
        ("batch mean", "the whole batch's mean reward"),
        # these two were told that a group mixed completions of different problems, and to check their loops
        ("sign flipped", "the sign is flipped"),
        ("mean over problems", "the mean over the problems (dim=0)"),
        ("a tensor in the row", "the metrics row cannot be logged: metric 'env/all/reward/by_problem' is a tensor"),
        ("std", "no division by the std"),
        ("aggregation", "aggregation='its default' where the config asks for 'seq_mean_token_mean'"),
        ("library defaults", "loss_fn='importance_sampling' where the config asks for 'ppo'"),
        ("no temperature", "temperature='its default' where the config asks for 0.9"),
        ("reward is correct", "the advantages come from the correctness (0 or 1), not the reward"),
        # was told it took the correctness, with the reward right there in its code
        ("graded as complete", "the advantages are right except on cut-off replies"),
        ("one forward_backward per group", "Call it once"),
        ("no forward_backward", "call forward_backward first"),
        ("no optim_step", "the weights never changed"),
        ("optim_step per group", "optimizer steps in one step; take exactly one"),
        ("optim_step twice", "2 optimizer steps in one step; take exactly one"),
        ("default lr", "learning rate 0.0001"),
        ("seed", "your prompts are not this step's problems"),
        ("one call per prompt", "Sample all the prompts in one sample_batch call"),
        ("no return", "did you forget the `return` statement?"),
    ],
)
def test_names_each_bug(base, bug, message):
    verdict = check(buggy_step(bug), base)
    assert verdict.status == FAILED
    assert message in verdict.message, verdict.message
    assert verdict.implementation is ch07._reference_grpo_step
    verdict.hints = ch07.check_grpo_step.hints
    assert_gives_nothing_away(verdict)


def test_a_sampler_made_outside_the_step_is_named(base):
    """A learner who reuses section 1's sampler never samples through this trainer: named as the stale mistake."""
    outside = llm.ServiceClient(device="cpu").create_training_client(base, keep_reference=False)
    sampler = outside.save_weights_and_get_sampling_client("elsewhere")

    def step_fn(config, trainer, renderer, task, step):
        trainer.save_weights_and_get_sampling_client = lambda name: sampler  # noqa: ARG005
        return solutions.grpo_step(config, trainer, renderer, task, step)

    verdict = check(step_fn, base)
    assert verdict.status == FAILED and "stale-sampler mistake" in verdict.message, verdict.message


def test_stub_and_crash(base):
    def stub(config, trainer, renderer, task, step):
        raise NotImplementedError

    def crash(config, trainer, renderer, task, step):
        return trainer.forward_backward([], "no_such_loss")

    assert check(stub, base).status == NOT_ATTEMPTED
    verdict = check(crash, base)
    assert verdict.status == FAILED and "ValueError" in verdict.message
    assert 'trainer.forward_backward([], "no_such_loss")' in verdict.message  # the learner's own line
    assert check("not a function", base).status == FAILED
