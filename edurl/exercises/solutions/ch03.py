"""Worked solution for Chapter 3. Open it with ``edurl.exercises.show_solution("baseline_losses")``."""


def baseline_losses(logprobs, returns, values):
    """Exercise 3.1: REINFORCE with a learned baseline. Returns (policy_loss, value_loss)."""
    # The advantage says how much better this return was than the critic expected.
    # The critic is only a baseline here: the policy loss must not push gradients into it.
    advantages = (returns - values).detach()
    policy_loss = -(logprobs * advantages).mean()
    # The critic learns by regression of V(s_t) onto the observed return G_t.
    value_loss = 0.5 * ((values - returns) ** 2).mean()
    return policy_loss, value_loss
