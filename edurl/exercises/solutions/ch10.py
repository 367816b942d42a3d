"""Worked solutions for Chapter 10. Open them with ``edurl.exercises.show_solution(name)``, name one of
"truncated_importance_weights", "soft_advantages" and "offline_step"."""

import torch


def truncated_importance_weights(train_logprobs, sampling_logprobs, mask, cap):
    """Exercise 10.1: the weight of each token of a stale batch, min(pi / q, cap), 0 off the actions.

    ``train_logprobs`` are the trainer's log-probs of the sampled tokens, ``sampling_logprobs`` the sampler's
    (older weights), ``mask`` 1 on action tokens; all (B, T). The ratio pi / q = exp(log pi - log q) corrects for
    sampling from the old policy; capping it at ``cap`` bounds what one rare token can do. The weight multiplies a
    gradient but gets none itself, so it is computed from detached log-probs.
    Example: log-ratios [0, log 3, -log 2] with cap 2 -> [1, 2, 0.5].
    """
    log_ratio = (train_logprobs - sampling_logprobs).detach()
    weights = torch.exp(log_ratio).clamp(max=cap)  # only from above: a small ratio is kept as it is
    return torch.where(mask != 0, weights, torch.zeros_like(weights))


def soft_advantages(rewards, tau):
    """Exercise 10.2: DRO's soft advantages, A = R - tau * log mean exp(R / tau) over each group.

    ``rewards`` is (P, G): G completions of each of P prompts; ``tau`` > 0. The baseline is a soft maximum of the
    group's rewards. exp(R / tau) overflows for a small tau (exp(100) is inf in float32), so take the group's
    largest reward out first: log mean exp(x) = m + log mean exp(x - m), with m = max(x).
    Example: rewards [[1, 0]], tau 1 -> baseline log((e + 1) / 2) = 0.620, advantages [[0.380, -0.620]].
    """
    scaled = rewards / tau
    top = scaled.max(dim=1, keepdim=True).values  # (P, 1)
    log_mean_exp = top + torch.log(torch.exp(scaled - top).mean(dim=1, keepdim=True))
    return rewards - tau * log_mean_exp


def offline_step(config, trainer, buffer, step):
    """Exercise 10.3: one step of offline DRO on groups logged in ``buffer`` (a RolloutBuffer).

    No sampling: the buffer holds each group's prompt, its completions with the log-probs of the policy that
    sampled them, and their rewards. Draw this step's groups, centre each group's rewards (GRPO's advantage), build
    one datum per completion with the *logged* log-probs (DRO's penalty measures the drift from them), and take one
    update with the config's loss (dro) and beta. Return forward_backward's metrics, with the loss and the drawn
    groups' mean reward.
    """
    from edurl.llm import AdamParams, build_datum
    from edurl.llm.offline import draw_groups

    drawn = draw_groups(buffer, config.batch_size, config.seed, step)  # this step's groups
    rewards = torch.tensor([buffer.rewards[i] for i in drawn])  # (P, G)
    advantages = rewards - rewards.mean(dim=1, keepdim=True)  # each group's mean as its baseline
    datums = []
    for n, i in enumerate(drawn):
        for j, (completion, logprobs) in enumerate(zip(buffer.completions[i], buffer.logprobs[i])):
            datums.append(build_datum(buffer.prompts[i], completion, logprobs, float(advantages[n, j])))
    out = trainer.forward_backward(
        datums,
        config.loss_fn,
        config.loss_fn_config(),  # {"beta": config.dro_beta}
        aggregation=config.aggregation,
        max_tokens=config.max_tokens,
        temperature=config.temperature,
    ).result()
    trainer.optim_step(AdamParams(learning_rate=config.learning_rate)).result()
    return {**out.metrics, "optim/loss": out.loss, "buffer/reward": float(rewards.mean())}
