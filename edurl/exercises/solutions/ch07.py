"""Worked solutions for Chapter 7. Open them with ``edurl.exercises.show_solution(name)``, name one of
"group_advantages", "ppo_loss", "masked_datums" and "grpo_step"."""

import torch

from edurl.exercises.solutions.ch06 import build_datum


def group_advantages(rewards):
    """Exercise 7.1: rewards (P, G), P prompts with G sampled completions each -> advantages (P, G).

    The baseline of a completion is the mean reward of its own group (the other answers to the same
    prompt), so keep the group axis: mean(dim=1, keepdim=True) is (P, 1) and broadcasts along G.
    No division by the std (Dr. GRPO): a group whose rewards are all equal simply gets 0 everywhere.
    Example: [[1, .5, 0, 1]] has mean .625 -> [[.375, -.125, -.625, .375]].
    """
    return rewards - rewards.mean(dim=1, keepdim=True)  # (P, G) - (P, 1)


def ppo_loss(train_logprobs, sampling_logprobs, advantages, clip_low_threshold=0.8, clip_high_threshold=1.2):
    """Exercise 7.3: the clipped surrogate, one loss per token; every input and the result share one shape.

    r = pi / pi_sampler, computed from log-probs as exp(lp - q) so the gradient flows into train_logprobs.
    min() is pessimistic: once r has left [clip_low_threshold, clip_high_threshold] in the direction A favours, the clipped
    term is the smaller one, it is constant in r, and the token's gradient is 0. Moves that undo a bad
    step (A > 0 with r < clip_low_threshold, A < 0 with r > clip_high_threshold) keep the unclipped term and its gradient.
    """
    ratio = torch.exp(train_logprobs - sampling_logprobs)
    clipped = ratio.clamp(clip_low_threshold, clip_high_threshold)
    return -torch.min(ratio * advantages, clipped * advantages)  # minimise the negative objective


def build_datums(prompt_tokens, completions, advantages):
    """Exercise 7.2: one masked Datum per completion of a group, each laid out by Exercise 6.1's build_datum
    (`show_solution("build_datum")` shows that layout)."""
    # completion i gets advantages[i]: the group's baseline already made them relative to each other
    return [
        build_datum(prompt_tokens, completion_tokens, sampling_logprobs, advantage)
        for (completion_tokens, sampling_logprobs), advantage in zip(completions, advantages)
    ]


def grpo_step(config, trainer, renderer, task, step):
    """Exercise 7.4, the capstone: one GRPO iteration, built from exercises 7.1 and 7.2. Returns the metrics row."""
    from edurl import llm
    from edurl.llm.clients import AdamParams

    seed = llm.problem_seed(config.seed, step)  # this step's problems and samples: a function of (seed, step)
    # 1. a fresh sampler: the weights as they are now, after the last optim_step
    sampler = trainer.save_weights_and_get_sampling_client(f"step_{step}")
    # 2. P problems, G completions each, in one batched call
    problems = task.sample(config.batch_size, split="train", seed=seed)
    prompts = [renderer.build_generation_prompt(p.messages()) for p in problems]
    params = llm.SamplingParams(
        max_tokens=config.max_tokens, temperature=config.temperature, stop=renderer.get_stop_sequences(), seed=seed
    )
    responses = sampler.sample_batch(prompts, config.group_size, params)
    # 3. grade: one row per problem, one column per completion of its group
    rewards = torch.zeros(config.batch_size, config.group_size)
    correct = torch.zeros(config.batch_size, config.group_size)
    for i, (problem, response) in enumerate(zip(problems, responses)):
        for j, seq in enumerate(response.sequences):
            message, complete = renderer.parse_response(seq.tokens, seq.stop_reason)
            g = llm.grade(message["content"], problem.answer, complete=complete)
            rewards[i, j], correct[i, j] = g.reward, float(g.correct)
    # 4. each completion against its own group's mean (exercise 7.1)
    advantages = group_advantages(rewards)
    # 5. one masked datum per completion, group by group (exercise 7.2)
    datums = []
    for prompt, response, group_adv in zip(prompts, responses, advantages):
        completions = [(s.tokens, s.logprobs) for s in response.sequences]
        datums += build_datums(prompt, completions, group_adv.tolist())
    # 6. the loss's gradient over the whole batch, then one optimizer step
    out = trainer.forward_backward(
        datums,
        config.loss_fn,
        config.loss_fn_config(),
        aggregation=config.aggregation,
        max_tokens=config.max_tokens,
        temperature=config.temperature,
    ).result()
    trainer.optim_step(AdamParams(learning_rate=config.learning_rate)).result()
    return {"env/all/reward/total": float(rewards.mean()), "env/all/correct": float(correct.mean()), **out.metrics}
