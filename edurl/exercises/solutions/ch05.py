"""Worked solution for Chapter 5. Open it with ``edurl.exercises.show_solution("clip_table")``."""


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
