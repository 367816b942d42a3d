"""GAE(lambda) under the microscope (Chapter 4): a plot of TD errors and advantages for one trajectory,
and the bias and variance of GAE(lambda) measured against Monte Carlo ground truth.

Ground truth needs many rollouts from the *same* states, so it runs on ``TorchCartPole``, whose
state can be set: thousands of continuations from each saved state step together as one batch.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from edurl.envs import TorchCartPole
from edurl.rl.advantages import gae, td_errors
from edurl.rl.networks import module_device, module_dtype
from edurl.utils import progress as progress_bar
from edurl.utils import torch_threads

__all__ = ["Trajectory", "sample_trajectory", "plot_gae", "rollouts_from", "gae_bias_variance"]

DEFAULT_LAMS = (0.0, 0.5, 0.9, 0.95, 1.0)


class Trajectory(dict):
    """One episode as (T, 1) tensors: rewards, values, next_values, terminated, truncated, plus states (T, 4)."""


@torch.no_grad()
def sample_trajectory(policy, value, *, seed: int = 0, max_steps: int = 500) -> Trajectory:
    """Play one CartPole episode with ``policy`` and record the critic's V(s_t) and V(s_{t+1}). The episode runs
    on the policy's device (a policy trained on a GPU plays there)."""
    dev = module_device(policy)
    env = TorchCartPole(1, max_episode_steps=max_steps, device=dev, check_actions=False)
    obs, _ = env.reset(seed=seed)
    gen = torch.Generator(device=dev).manual_seed(seed)
    rows = {k: [] for k in ("states", "actions", "rewards", "next_obs", "terminated", "truncated")}
    while True:
        probs = policy(obs).probs
        action = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        rows["states"].append(obs[0])
        rows["actions"].append(action[0])
        obs, reward, terminated, truncated, info = env.step(action)
        rows["rewards"].append(reward[0])
        rows["next_obs"].append(info["final_obs"][0])
        rows["terminated"].append(terminated[0])
        rows["truncated"].append(truncated[0])
        if terminated[0] or truncated[0]:
            break
    states, next_obs = torch.stack(rows["states"]), torch.stack(rows["next_obs"])
    return Trajectory(
        states=states,
        actions=torch.stack(rows["actions"]),
        rewards=torch.stack(rows["rewards"])[:, None],
        values=value(states)[:, None],
        next_values=value(next_obs)[:, None],
        terminated=torch.stack(rows["terminated"])[:, None],
        truncated=torch.stack(rows["truncated"])[:, None],
    )


def plot_gae(traj: Trajectory, gamma: float = 0.99, lams=DEFAULT_LAMS, *, ax=None, gae_fn=gae):
    """TD errors (bars) and GAE(lambda) advantages (lines) along one trajectory."""
    ax = ax if ax is not None else plt.subplots(figsize=(9, 4))[1]
    args = (traj["rewards"], traj["values"], traj["next_values"], traj["terminated"])
    deltas = td_errors(*args, gamma)[:, 0]
    t = np.arange(len(deltas))
    ax.bar(t, deltas.cpu().numpy(), color="lightgray", label="TD error $\\delta_t$")
    for lam in lams:
        adv, _ = gae_fn(*args, traj["truncated"], gamma, lam)
        ax.plot(t, adv[:, 0].cpu().numpy(), label=f"GAE, $\\lambda$ = {lam:g}")
    ax.axhline(0, color="black", lw=0.5)
    ax.set(xlabel="t", ylabel="advantage", title=f"TD errors and GAE advantages, $\\gamma$ = {gamma:g}")
    ax.legend(fontsize=8, ncol=2)
    return ax


@torch.no_grad()
def rollouts_from(
    policy, states: torch.Tensor, first_actions: torch.Tensor, horizon: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Continue CartPole from each row of ``states`` (B, 4): take ``first_actions`` (B,), then follow the policy.

    Returns time-major (H, B) rewards / terminated / truncated and (H, B, 4) ``obs`` (s_t) and ``next_obs``
    (the true s_{t+1}: the final observation where an episode ended). Rows after an episode's end belong
    to the env's next episode; ``truncated`` is True at the last step so that GAE bootstraps whatever is
    still running there.
    """
    B = states.shape[0]
    env = TorchCartPole(B, dtype=states.dtype, max_episode_steps=10**9, device=states.device, check_actions=False)
    env.reset(seed=int(torch.randint(0, 2**31, (1,), generator=generator, device=generator.device)))
    env.state = states.clone()
    obs = states.clone()
    out = {k: [] for k in ("obs", "next_obs", "rewards", "terminated")}
    for t in range(horizon):
        if t == 0:
            actions = first_actions
        else:
            actions = torch.multinomial(policy(obs.to(module_dtype(policy))).probs, 1, generator=generator).squeeze(-1)
        out["obs"].append(obs)
        obs, reward, terminated, _, info = env.step(actions)
        out["next_obs"].append(info["final_obs"])  # every env's state after the step, before any reset
        out["rewards"].append(reward)
        out["terminated"].append(terminated)
    ro = {k: torch.stack(v) for k, v in out.items()}
    ro["truncated"] = torch.zeros_like(ro["terminated"])
    ro["truncated"][-1] = ~ro["terminated"][-1]
    return ro


def _first_episode_returns(ro: dict, gamma: float) -> torch.Tensor:
    """Discounted return of the first episode in each column. (B,)"""
    H = ro["rewards"].shape[0]
    alive = torch.cumprod(torch.cat([torch.ones_like(ro["terminated"][:1]), ~ro["terminated"][:-1]]).float(), 0)
    discounts = gamma ** torch.arange(H, dtype=ro["rewards"].dtype, device=ro["rewards"].device)[:, None]
    return (ro["rewards"] * alive * discounts).sum(0)


@torch.no_grad()
def _truth_returns(policy, state, action, n: int, horizon: int, gamma: float, gen, tail_gen) -> torch.Tensor:
    """The discounted returns of ``n`` rollouts from (state, action) that follow ``policy``: the first ``horizon``
    steps from ``gen``, then, for the rollouts still in their first episode, more of ``horizon`` steps each (their
    randomness from ``tail_gen``, so that runs whose rollouts all end in time draw as before) until gamma ** steps
    is below 1e-6. A return cut at the horizon once left a policy that balances 300 steps ~5 short at gamma 0.99,
    which GAE's bootstrapped estimates are not: lambda = 1 then looked biased with an exact critic. (n,)"""
    ro = rollouts_from(policy, state.expand(n, 4), action.expand(n), horizon, gen)
    q = _first_episode_returns(ro, gamma)
    alive, last, steps = ~ro["terminated"].any(0), ro["next_obs"][-1], horizon
    while alive.any() and gamma**steps >= 1e-6:
        first = torch.multinomial(policy(last[alive].to(module_dtype(policy))).probs, 1, generator=tail_gen).squeeze(-1)
        tail = rollouts_from(policy, last[alive], first, horizon, tail_gen)
        q[alive] += gamma**steps * _first_episode_returns(tail, gamma)
        still = alive.clone()
        still[alive] = ~tail["terminated"].any(0)
        last[alive] = tail["next_obs"][-1]
        alive, steps = still, steps + horizon
    return q


@torch.no_grad()
def gae_bias_variance(
    policy,
    value,
    states: torch.Tensor,
    actions: torch.Tensor,
    *,
    gamma: float = 0.99,
    lams=None,
    num_truth: int = 2048,
    num_samples: int = 256,
    horizon: int = 300,
    seed: int = 0,
    progress: bool = True,
    gae_fn=gae,
) -> pd.DataFrame:
    """Bias and variance of GAE(lambda) at t = 0 from each saved (state, action), against Monte Carlo truth.

    Target: Q^pi(s, a) - V(s), with Q^pi the mean discounted return of ``num_truth`` rollouts that start
    with action a and then follow pi, and V the fixed critic. Any function of the state alone can be
    subtracted without biasing the policy gradient, so this is the advantage whose errors matter: the
    true A^pi(s, a) = Q^pi(s, a) - V^pi(s) differs from it only by V^pi(s) - V(s), the same for every
    action. Estimates: ``num_samples`` independent rollouts from (s, a), each turned into GAE(lambda)
    advantages with the same critic. Returns one row per lambda: bias^2 and variance averaged over the
    states, and their sum (the mean squared error of a single GAE estimate). bias^2 is corrected for the
    two sources of noise in measuring it (the sample mean's variance/num_samples and ``truth_se2``, the
    squared standard error of the Monte Carlo target), so a value near 0 may come out slightly negative.
    ``lams`` defaults to 0, 0.1, ..., 1. ``gae_fn`` computes the estimates (your exercise 4.1 in the notebook).
    """
    lams = np.linspace(0, 1, 11) if lams is None else lams
    with torch_threads(1):  # small nets: fastest, and repeatable across machines, on one thread
        dev = module_device(policy)  # the rollouts run where the policy is
        states, actions = states.to(dev), actions.to(dev)
        gen = torch.Generator(device=dev).manual_seed(seed)
        tail_gen = torch.Generator(device=dev).manual_seed(seed + 1)
        per_state, value_dtype = [], module_dtype(value)  # the nets take inputs of their own dtype
        for s, a in progress_bar(list(zip(states, actions)), desc="states", disable=not progress):
            s64 = s.to(torch.float64)
            q = _truth_returns(policy, s64, a, num_truth, horizon, gamma, gen, tail_gen)
            truth = q.mean() - value(s[None].to(value_dtype)).double()[0]
            truth_se2 = q.var() / num_truth
            est = rollouts_from(policy, s64.expand(num_samples, 4), a.expand(num_samples), horizon, gen)
            values = value(est["obs"].to(value_dtype)).double()
            next_values = value(est["next_obs"].to(value_dtype)).double()
            for lam in lams:
                adv, _ = gae_fn(
                    est["rewards"], values, next_values, est["terminated"], est["truncated"], gamma, float(lam)
                )
                a0 = adv[0]
                # E[(mean - truth)^2] = bias^2 + var/num_samples + truth_se2: remove the two noise terms
                bias2 = (a0.mean() - truth) ** 2 - a0.var() / num_samples - truth_se2
                per_state.append(
                    {
                        "lam": float(lam),
                        "bias2": bias2.item(),
                        "variance": a0.var().item(),
                        "truth_se2": truth_se2.item(),
                    }
                )
        df = pd.DataFrame(per_state).groupby("lam", as_index=False).mean()
        df["mse"] = df["bias2"] + df["variance"]
        return df
