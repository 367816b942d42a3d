"""Worked solution for Chapter 2. Open it with ``edurl.exercises.show_solution("reinforce_loss")``."""


def reinforce_loss(logprobs, returns):
    """Exercise 2.1: -mean(log pi(a_t|s_t) * normalised G_t)."""
    # Normalise the returns over the batch: subtracting the mean is a baseline (Chapter 3),
    # dividing by the std keeps the step size steady as episodes get longer.
    weights = (returns - returns.mean()) / (returns.std() + 1e-8)
    # The returns are data, not something to differentiate through.
    weights = weights.detach()
    # Gradient *descent* on this loss is gradient *ascent* on sum log pi * G: hence the minus sign.
    return -(logprobs * weights).mean()
