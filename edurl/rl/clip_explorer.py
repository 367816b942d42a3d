"""The clipped objective made visible (Chapter 5): PPO's per-sample objective and its gradient against the ratio.

Everything is computed with ``edurl.objectives.clipped_surrogate`` (the function PPO trains with) and autograd, so the figure shows what the
training code actually does, including exactly where the gradient is zero.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import torch

from edurl.objectives import clipped_surrogate

__all__ = ["clip_objective_and_grad", "clip_case", "plot_clip_explorer"]


def clip_objective_and_grad(
    ratios: torch.Tensor, advantage: float, clip_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Objective min(r*A, clip(r)*A) (the negated loss) and its derivative with respect to r, at each ratio.

    ``ratios`` (a tensor, array or list) must be finite and > 0: a ratio is pi_theta / pi_old of a sampled action,
    and the training code takes it as exp of a log-prob difference, so r = 0 (log 0) has no gradient."""
    r = torch.as_tensor(ratios, dtype=torch.float64).detach().clone()
    if not bool((torch.isfinite(r) & (r > 0)).all()):
        raise ValueError(
            f"ratios must be finite and > 0 (pi_theta / pi_old of a sampled action), got {r[~(r > 0)][:3].tolist()} "
            "among them: start a sweep above 0, e.g. torch.linspace(0.01, 2, 400)."
            if bool((r <= 0).any())
            else f"ratios must be finite and > 0, got {r[~torch.isfinite(r)][:3].tolist()} among them."
        )
    r.requires_grad_(True)
    adv = torch.full_like(r, advantage)
    objective = -clipped_surrogate(torch.log(r), torch.zeros_like(r), adv, 1 - clip_eps, 1 + clip_eps)
    objective.sum().backward()
    return objective.detach(), r.grad


def clip_case(ratio: float, advantage: float, clip_eps: float) -> tuple[str, bool]:
    """Which term min() picks at this ratio ("unclipped", "clipped" or "both": equal) and whether the gradient is 0."""
    r = torch.tensor([ratio], dtype=torch.float64)
    objective, grad = clip_objective_and_grad(r, advantage, clip_eps)
    unclipped = ratio * advantage
    clipped = float(np.clip(ratio, 1 - clip_eps, 1 + clip_eps)) * advantage
    # a tight tolerance: np.isclose's default (1e-5) called r = 1.200001 "both" at eps = 0.2
    picks = (
        "both"
        if math.isclose(unclipped, clipped, rel_tol=1e-12, abs_tol=1e-300)
        else ("unclipped" if abs(objective.item() - unclipped) <= abs(objective.item() - clipped) else "clipped")
    )
    return picks, bool(grad.item() == 0.0)


def plot_clip_explorer(clip_eps: float = 0.2, *, axes=None):
    """Two panels (A = +1, A = -1): the objective and its gradient against r in [0, 2], clip range shaded."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 4))
    r = torch.linspace(0.01, 2.0, 400, dtype=torch.float64)
    for ax, adv in zip(axes, (1.0, -1.0)):
        objective, grad = clip_objective_and_grad(r, adv, clip_eps)
        ax.plot(r, r * adv, color="gray", ls=":", label="unclipped $rA$")
        ax.plot(r, objective, lw=2.5, label="PPO objective $\\min(rA, \\mathrm{clip}(r)A)$")
        ax.plot(r, grad, color="tab:red", lw=1.5, label="its gradient $d/dr$")
        ax.axvspan(1 - clip_eps, 1 + clip_eps, color="tab:green", alpha=0.12, label="$[1-\\epsilon, 1+\\epsilon]$")
        ax.axhline(0, color="black", lw=0.5)
        ax.set(
            xlabel="ratio $r = \\pi_\\theta / \\pi_{old}$",
            title=f"A {'> 0' if adv > 0 else '< 0'}, $\\epsilon$ = {clip_eps:.2f}",
            ylim=(-2.2, 2.2),
        )
        ax.legend(fontsize=8, loc="upper left" if adv > 0 else "lower left")
    return axes
