"""Why PPO needs a trust region, measured (Chapter 5).

Two experiments:

- :func:`importance_sampling_study`: importance sampling is exact on average, E_q[(pi/q) f] = E_pi[f], but its
  variance grows quickly as pi drifts from the sampling distribution q. Here q = N(0, 1), pi = N(mu, 1) and
  f(x) = x, where everything has a closed form: E_pi[f] = mu, KL(pi || q) = mu^2 / 2 and the variance of one
  weighted sample, Var_q[(pi/q) x] = exp(mu^2) (1 + 4 mu^2) - mu^2 (the derivation is in the chapter).
- :func:`clip_vs_no_clip`: PPO's epochs on one batch, with the clip and without it. Without the clip nothing stops
  the ratio from running off, and the KL from pi_old grows epoch after epoch.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import matplotlib.pyplot as plt
import pandas as pd
import torch

from edurl.rl.ppo import PPOBatch, PPOConfig, ppo_diagnostics, ppo_update

__all__ = ["clip_vs_no_clip", "exact_is_variance", "importance_sampling_study", "plot_trust_region"]


def exact_is_variance(mu: float) -> float:
    """Var_q[(pi/q)(x) * x] for q = N(0, 1), pi = N(mu, 1): exp(mu^2) (1 + 4 mu^2) - mu^2.

    Since pi(x)^2 / q(x) = exp(mu^2) N(x; 2 mu, 1), E_q[w^2 x^2] = exp(mu^2) E_{N(2 mu, 1)}[x^2]
    = exp(mu^2) (1 + 4 mu^2), and the mean is mu. At mu = 0 it is Var_q[x] = 1.
    """
    return math.exp(mu**2) * (1 + 4 * mu**2) - mu**2


def importance_sampling_study(
    shifts=(0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5),
    batch_size: int = 256,
    num_batches: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """Estimate E_pi[x] = mu by importance sampling from q = N(0, 1), ``num_batches`` times with ``batch_size``
    samples each, for each shift mu of pi = N(mu, 1).

    Returns one row per shift: ``kl`` = KL(pi || q) = mu^2 / 2; ``mean_estimate`` (the average over all batches,
    close to mu: the estimator is unbiased); ``batch_std``, the measured spread of one batch's estimate, beside
    ``exact_batch_std`` = sqrt(exact_is_variance(mu) / batch_size); and ``ess_fraction``, the median effective
    sample size (sum w)^2 / sum w^2 of a batch as a share of ``batch_size``.
    """
    g = torch.Generator().manual_seed(seed)
    rows = []
    for mu in shifts:
        x = torch.randn(num_batches, batch_size, generator=g, dtype=torch.float64)  # samples of q
        w = torch.exp(mu * x - mu**2 / 2)  # pi(x) / q(x) for unit-variance Gaussians
        estimates = (w * x).mean(1)  # (num_batches,)
        ess = w.sum(1) ** 2 / (w**2).sum(1) / batch_size
        rows.append(
            dict(
                shift=mu,
                kl=mu**2 / 2,
                mean_estimate=estimates.mean().item(),
                batch_std=estimates.std().item(),
                exact_batch_std=math.sqrt(exact_is_variance(mu) / batch_size),
                ess_fraction=ess.median().item(),
            )
        )
    return pd.DataFrame(rows)


@torch.no_grad()
def _distance(policy, batch: PPOBatch, clip_eps: float) -> dict[str, float]:
    train_logprobs, _ = policy.logprob_and_entropy(batch.obs, batch.actions)
    _, k3, clipped = ppo_diagnostics(train_logprobs, batch.sampling_logprobs, clip_eps)
    log_ratio = train_logprobs - batch.sampling_logprobs
    return dict(
        approx_kl_k3=k3.item(),
        max_ratio=log_ratio.exp().max().item(),
        min_ratio=log_ratio.exp().min().item(),
        clip_fraction=clipped.item(),
    )


def clip_vs_no_clip(
    policy, value, batch: PPOBatch, config: PPOConfig | None = None, *, epochs: int = 20, clip_eps: float = 0.2
) -> pd.DataFrame:
    """Run ``epochs`` passes of :func:`ppo_update` over one ``batch`` from copies of ``policy`` and ``value``,
    once with the clip (``clip_eps``) and once without it (an infinite clip range: the plain importance-weighted
    surrogate), each with a fresh Adam at ``config.learning_rate``. Both runs start from the same state of
    torch's random generator, so with ``num_minibatches`` > 1 they shuffle the batch alike and differ only by the
    clip; the caller's generator is left as it was.

    Returns one row per (run, epoch), epoch 0 being the start, with the k3 approx KL from pi_old, the largest
    and smallest ratio pi / pi_old over the batch, and the clip fraction (the share of samples outside
    [1 - clip_eps, 1 + clip_eps]).
    """
    config = config or PPOConfig()
    one_epoch = dataclasses.replace(config, update_epochs=1, target_kl=None)
    rows = []
    where = batch.actions.device  # ppo_update's minibatches draw from this device's generator
    devices = [where.index or 0] if where.type == "cuda" else []
    for name, eps in (("clipped", clip_eps), ("no clip", math.inf)):
        p, v = copy.deepcopy(policy), copy.deepcopy(value)
        optimizer = torch.optim.Adam([*p.parameters(), *v.parameters()], lr=config.learning_rate, eps=1e-5)
        rows.append(dict(run=name, epoch=0, **_distance(p, batch, clip_eps)))
        with torch.random.fork_rng(devices=devices):  # each run from the same generator state, restored after
            for epoch in range(1, epochs + 1):
                ppo_update(p, v, optimizer, batch, one_epoch, eps)
                rows.append(dict(run=name, epoch=epoch, **_distance(p, batch, clip_eps)))
    return pd.DataFrame(rows)


def plot_trust_region(is_study: pd.DataFrame, epochs_study: pd.DataFrame, *, axes=None):
    """Left: the spread of an importance-sampled estimate against KL(pi || q), measured and exact. Right: the
    KL from pi_old over PPO's epochs on one batch, with and without the clip."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(13, 4))
    ax = axes[0]
    ax.plot(is_study["kl"], is_study["batch_std"], "o-", label="measured")
    ax.plot(is_study["kl"], is_study["exact_batch_std"], "k--", lw=1, label="exact")
    ax.set(
        xlabel="KL(π ‖ q)",
        ylabel="std of a 256-sample estimate",
        yscale="log",
        title="importance sampling: spread grows with the drift",
    )
    ax.legend()
    ax = axes[1]
    for name, df in epochs_study.groupby("run", sort=False):
        df = df[df["epoch"] > 0]  # epoch 0 is the start, where the KL is 0
        ax.plot(df["epoch"], df["approx_kl_k3"], "o-", ms=3, label=name)
    ax.set(
        xlabel="epochs over the same batch",
        ylabel="approx KL (k3) from π_old",
        yscale="log",
        title="PPO's epochs on one batch",
    )
    ax.legend()
    return axes
