"""Worked solutions for Chapter 8. Open them with ``edurl.exercises.show_solution(name)``, name one of
"bradley_terry_loss", "dpo_loss" and "kl_shaped_rewards"."""

import torch


def bradley_terry_loss(chosen_rewards, rejected_rewards):
    """Exercise 8.1: the reward model's loss on B labelled pairs; (B,) and (B,) -> a scalar.

    Bradley-Terry says P(chosen preferred) = sigmoid(r_c - r_r); the loss is the negative log-likelihood of the
    labels, averaged over pairs. logsigmoid computes log(sigmoid(x)) without forming sigmoid(x), which rounds to 0
    (and its log to -inf) once the reward model is confidently wrong, x < -88 in float32.
    Example: equal rewards give log 2 = 0.6931; a margin of log 3 gives -log(3/4) = 0.2877.
    """
    margin = chosen_rewards - rejected_rewards  # (B,): how much more the reward model likes the chosen reply
    # the mean, not the sum, so the loss (and the step size) does not grow with the batch
    return -torch.nn.functional.logsigmoid(margin).mean()


def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
    """Exercise 8.2: DPO, Bradley-Terry on the implicit reward beta * (log pi - log ref); four (B,) summed sequence
    log-probs and beta -> a scalar. The reference's log-probs are constants: only the policy's get a gradient.
    Example: at pi = ref every margin is 0 and the loss is log 2, whatever beta.
    """
    # how much more likely the policy makes each reply than the frozen reference does (log of the ratio)
    chosen_log_ratio = policy_chosen_logps - ref_chosen_logps  # (B,)
    rejected_log_ratio = policy_rejected_logps - ref_rejected_logps  # (B,)
    # beta scales the margin inside the log-sigmoid: it is the strength of the KL tie to the reference
    return -torch.nn.functional.logsigmoid(beta * (chosen_log_ratio - rejected_log_ratio)).mean()


def kl_shaped_rewards(rewards, logprobs, ref_logprobs, mask, kl_coef):
    """Exercise 8.3: the RLHF reward of each reply, the reward model's score minus kl_coef times the reply's
    log-ratio to the reference summed over its own tokens; rewards (B,), the rest (B, T) -> (B,).
    Example: reward 1, reply log-ratios 0.5 and 0.25, kl_coef 0.4: 1 - 0.4 * 0.75 = 0.7.
    """
    log_ratio = logprobs - ref_logprobs  # (B, T): log pi - log ref of each sampled token
    # only the reply's tokens count: the prompt and the padding were not sampled (mask may be 0/1 floats or bools)
    reply_only = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    kl = reply_only.sum(dim=1)  # (B,): the single-sample estimate of KL(pi || ref) for each reply
    return rewards - kl_coef * kl
