"""Worked solutions for Chapter 5. Open one with ``edurl.exercises.show_solution(name)``, for name in
"clip_table", "clip_values" and "ppo_update"."""


def clip_table():
    """Exercise 5.1: which term min(r*A, clip(r)*A) picks, and whether the gradient is zero (eps = 0.2).

    A > 0: pushing r up is rewarded, but only until 1 + eps. Above it the clipped term is smaller, so it
    is picked and its gradient is 0: no incentive to go further. Below 1 - eps the unclipped r*A is
    smaller, so it is picked and the gradient still pulls r back up.
    A < 0: the mirror image. Below 1 - eps the clipped term (-0.8 vs -0.5 at r = 0.5) is smaller, so it
    is picked and the gradient is 0. Above 1 + eps the unclipped r*A is smaller, so the gradient stays
    and pushes r back down. Inside the range both terms are equal and the gradient is A.
    Why it helps: the objective stops rewarding a move once the ratio leaves the trust region in the
    direction the advantage favours, so several epochs on one batch cannot push the policy far from the
    one that collected it. Moves that *undo* a bad step are never clipped.
    """
    return {
        ("A > 0", "r < 1 - eps"): {"min picks": "unclipped", "gradient is zero": False},
        ("A > 0", "inside"): {"min picks": "both", "gradient is zero": False},
        ("A > 0", "r > 1 + eps"): {"min picks": "clipped", "gradient is zero": True},
        ("A < 0", "r < 1 - eps"): {"min picks": "clipped", "gradient is zero": True},
        ("A < 0", "inside"): {"min picks": "both", "gradient is zero": False},
        ("A < 0", "r > 1 + eps"): {"min picks": "unclipped", "gradient is zero": False},
    }


def clip_values():
    """Exercise 5.2: the two terms of PPO's objective and the objective itself, by hand (eps = 0.2).

    The clipped term clips the *ratio* to [0.8, 1.2] and then multiplies by A; the objective is the smaller
    of the two terms, for either sign of A.
    """
    return {
        # (A, r): (r * A, clip(r, 0.8, 1.2) * A, min of the two)
        (2.0, 1.5): (3.0, 2.4, 2.4),  # A > 0, r above 1 + eps: the clip caps the gain
        (2.0, 0.5): (1.0, 1.6, 1.0),  # A > 0, r below 1 - eps: unclipped, so the gradient still pulls r up
        (-1.0, 0.5): (-0.5, -0.8, -0.8),  # A < 0, r below 1 - eps: the clip binds (the smaller is -0.8)
        (-1.0, 1.5): (-1.5, -1.2, -1.5),  # A < 0, r above 1 + eps: unclipped, the move gets undone
        (1.0, 1.1): (1.1, 1.1, 1.1),  # inside the range both terms agree
    }


def ppo_update(policy, value, optimizer, batch, config, clip_eps):
    """Exercise 5.3: PPO's epochs of minibatch steps on one batch (target_kl and clip_value left out)."""
    import torch

    params = list(policy.parameters()) + list(value.parameters())
    for _epoch in range(config.update_epochs):
        # a fresh shuffle each epoch, drawn the way the reference draws it
        for idx in batch.minibatches(config.num_minibatches):
            logprobs, entropy = policy.logprob_and_entropy(batch.obs[idx], batch.actions[idx])
            # standardise the advantages within the minibatch
            adv = batch.advantages[idx]
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            # the ratio against pi_old, the policy that sampled the batch
            ratio = torch.exp(logprobs - batch.sampling_logprobs[idx])
            unclipped = ratio * adv
            clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv
            policy_loss = -torch.min(unclipped, clipped).mean()
            value_loss = 0.5 * ((value(batch.obs[idx]) - batch.returns[idx]) ** 2).mean()
            loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy.mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            optimizer.step()
