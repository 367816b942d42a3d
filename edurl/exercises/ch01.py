"""Checkers for Chapter 1's exercises: discounted returns (1.1) and one Bellman backup (1.2)."""

from __future__ import annotations

import torch

from edurl.exercises._core import Case, Diagnosis, Hints, Verdict, run_checker, with_hints
from edurl.exercises.solutions import ch01 as _solutions
from edurl.rl.returns import discounted_returns as _ref_returns
from edurl.rl.tabular import TabularMDP
from edurl.rl.tabular import bellman_backup as _ref_backup

__all__ = ["check_discounted_returns", "check_bellman_backup"]


# ---------------------------------------------------------------------------------------------
# Exercise 1.1: discounted_returns(rewards, dones, gamma)
# ---------------------------------------------------------------------------------------------


def _returns_no_reset(rewards, dones, gamma):
    return _ref_returns(rewards, torch.zeros_like(dones), gamma)


def _returns_reset_one_step_late(rewards, dones, gamma):
    shifted = torch.zeros_like(dones)
    shifted[:-1] = dones[1:]  # resets as if each episode ended one step earlier
    return _ref_returns(rewards, shifted, gamma)


def _returns_forward(rewards, dones, gamma):
    out, running = torch.empty_like(rewards), torch.zeros_like(rewards[0])
    for t in range(rewards.shape[0]):
        running = rewards[t] + gamma * running
        out[t] = running
        running = running * (~dones[t])
    return out


def _returns_undiscounted(rewards, dones, gamma):
    return _ref_returns(rewards, dones, 1.0)


_RETURNS_DIAGNOSES = [
    Diagnosis(
        _returns_no_reset,
        "your returns flow across episode boundaries. When dones[t] is True, step t was "
        "the last of its episode, so G_t = r_t: do not add gamma * G_{t+1} there.",
    ),
    Diagnosis(
        _returns_reset_one_step_late,
        "the reset is off by one step. Use dones[t] (did *this* step end the "
        "episode?) when computing G_t, not dones[t+1] or the done of the step before.",
    ),
    Diagnosis(
        _returns_forward,
        "you summed the rewards *before* each step. Reward-to-go looks forward: loop "
        "t = T-1, ..., 0 so that G_{t+1} is ready when you compute G_t.",
    ),
    Diagnosis(_returns_undiscounted, "gamma seems unused: each later reward must be weighted by gamma**k."),
]


def _returns_cases() -> list[Case]:
    T, F = True, False
    g = torch.Generator().manual_seed(0)
    cases = [
        Case(
            "one episode, no ends",
            dict(rewards=torch.tensor([[1.0], [2.0], [3.0]]), dones=torch.tensor([[F], [F], [F]]), gamma=0.5),
        ),
        Case(
            "two episodes in one column",
            dict(
                rewards=torch.tensor([[1.0], [1.0], [1.0], [1.0]]), dones=torch.tensor([[F], [T], [F], [T]]), gamma=0.9
            ),
        ),
        Case(
            "ends at different steps in two envs",
            dict(
                rewards=torch.tensor([[1.0, 0.0], [2.0, 1.0], [0.0, 1.0], [3.0, 2.0], [1.0, 1.0]]),
                dones=torch.tensor([[F, F], [T, F], [F, T], [F, F], [T, F]]),
                gamma=0.9,
            ),
        ),
        Case(
            "gamma = 0",
            dict(rewards=torch.tensor([[1.0, -1.0], [2.0, 0.5]]), dones=torch.tensor([[F, F], [F, T]]), gamma=0.0),
        ),
        Case(
            "gamma = 1",
            dict(
                rewards=torch.tensor([[1.0], [2.0], [3.0], [4.0]]), dones=torch.tensor([[F], [F], [T], [F]]), gamma=1.0
            ),
        ),
        Case(
            "every step ends an episode",
            dict(rewards=torch.tensor([[1.0, 2.0], [3.0, 4.0]]), dones=torch.ones(2, 2, dtype=torch.bool), gamma=0.99),
        ),
        Case(
            "a single step", dict(rewards=torch.tensor([[5.0, -2.0, 0.5]]), dones=torch.tensor([[F, T, F]]), gamma=0.9)
        ),
        Case(
            "float64 rewards",
            dict(rewards=torch.tensor([[0.5], [0.25]], dtype=torch.float64), dones=torch.tensor([[F], [F]]), gamma=0.5),
        ),
    ]
    for i, (steps, envs) in enumerate([(7, 3), (20, 4), (64, 8)]):
        cases.append(
            Case(
                f"random rollout {steps}x{envs}",
                dict(
                    rewards=torch.randn(steps, envs, generator=g),
                    dones=torch.rand(steps, envs, generator=g) < 0.2,
                    gamma=[0.9, 0.99, 0.5][i],
                ),
            )
        )
    return cases


_HINTS_DISCOUNTED_RETURNS = Hints(
    idea=(
        "The return from step t is the reward at t plus the discounted return from the next step, and nothing"
        " after an episode's end counts. Walk through time from the last step to the first, carrying a "
        "running sum that restarts at every done."
    ),
    formula="G_t = r_t + gamma * G_{t+1} * (1 - done_t), computed backwards in time; "
    "return a tensor with the same shape and dtype as rewards.",
    solution=_solutions.discounted_returns,
)


@with_hints(_HINTS_DISCOUNTED_RETURNS)
def check_discounted_returns(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``discounted_returns(rewards, dones, gamma)`` on (T, N) rollouts."""
    return run_checker(
        "Exercise 1.1 discounted_returns",
        fn,
        _ref_returns,
        _returns_cases(),
        diagnoses=_RETURNS_DIAGNOSES,
        verbose=verbose,
        hints=_HINTS_DISCOUNTED_RETURNS,
    )


# ---------------------------------------------------------------------------------------------
# Exercise 1.2: bellman_backup(V, policy, mdp, gamma)
# ---------------------------------------------------------------------------------------------


def _backup_no_terminal_mask(V, policy, mdp, gamma):
    Q = mdp.R + gamma * torch.einsum("sat,t->sa", mdp.P, V)
    return (policy * Q).sum(-1).masked_fill(mdp.terminal, 0.0)


def _backup_no_terminal_mask_at_all(V, policy, mdp, gamma):
    return (policy * (mdp.R + gamma * torch.einsum("sat,t->sa", mdp.P, V))).sum(-1)


def _backup_terminal_not_zeroed(V, policy, mdp, gamma):
    return (policy * (mdp.R + gamma * torch.einsum("sat,t->sa", mdp.P, V.masked_fill(mdp.terminal, 0.0)))).sum(-1)


def _backup_terminal_keeps_V(V, policy, mdp, gamma):
    return torch.where(mdp.terminal, V, _backup_terminal_not_zeroed(V, policy, mdp, gamma))


def _backup_max(V, policy, mdp, gamma):
    Q = mdp.R + gamma * torch.einsum("sat,t->sa", mdp.P, V.masked_fill(mdp.terminal, 0.0))
    return Q.max(-1).values.masked_fill(mdp.terminal, 0.0)


def _backup_uniform(V, policy, mdp, gamma):
    return _ref_backup(V, torch.full_like(policy, 1.0 / policy.shape[1]), mdp, gamma)


def _backup_discounted_reward(V, policy, mdp, gamma):
    Q = gamma * (mdp.R + torch.einsum("sat,t->sa", mdp.P, V.masked_fill(mdp.terminal, 0.0)))
    return (policy * Q).sum(-1).masked_fill(mdp.terminal, 0.0)


def _backup_transposed(V, policy, mdp, gamma):
    Q = mdp.R + gamma * torch.einsum("tas,t->sa", mdp.P, V.masked_fill(mdp.terminal, 0.0))
    return (policy * Q).sum(-1).masked_fill(mdp.terminal, 0.0)


_NO_MASK_HINT = (
    "you bootstrap from terminal states. Arriving in a terminal state ends the episode, so use "
    "V(s') = 0 there, and return V'(s) = 0 for terminal s (mdp.terminal marks them)."
)
_BACKUP_DIAGNOSES = [
    Diagnosis(_backup_no_terminal_mask, _NO_MASK_HINT),
    Diagnosis(_backup_no_terminal_mask_at_all, _NO_MASK_HINT),
    *(
        Diagnosis(
            wrong,
            "V(s') = 0 after a terminal state is right, but a terminal state itself must get V'(s) = 0: the "
            "episode has ended there, so no reward follows. Set V' to 0 where mdp.terminal is True.",
        )
        for wrong in (_backup_terminal_not_zeroed, _backup_terminal_keeps_V)
    ),
    Diagnosis(
        _backup_max,
        "you took the max over actions: that is value iteration's optimality backup. "
        "Policy evaluation averages Q(s, a) with the policy's probabilities pi(a|s).",
    ),
    Diagnosis(_backup_uniform, "you averaged over actions uniformly. Weight each action by policy[s, a]."),
    Diagnosis(
        _backup_discounted_reward,
        "the immediate reward is not discounted: Q = R + gamma * E[V(s')], not gamma * (R + E[V(s')]).",
    ),
    Diagnosis(
        _backup_transposed,
        "the expectation sums over the wrong axis of P. P[s, a, s'] is the probability "
        "of s' given (s, a): sum over the last axis, e.g. mdp.P @ V.",
    ),
]


def _random_mdp(S: int, A: int, num_terminal: int, g: torch.Generator) -> TabularMDP:
    P = torch.rand(S, A, S, generator=g, dtype=torch.float64) ** 3
    P = P / P.sum(-1, keepdim=True)
    R = torch.randn(S, A, generator=g, dtype=torch.float64)
    terminal = torch.zeros(S, dtype=torch.bool)
    terminal[torch.randperm(S, generator=g)[:num_terminal]] = True
    return TabularMDP(P, R, terminal)


def _random_policy(S: int, A: int, g: torch.Generator) -> torch.Tensor:
    return torch.softmax(2 * torch.randn(S, A, generator=g, dtype=torch.float64), -1)


def _backup_cases() -> list[Case]:
    g = torch.Generator().manual_seed(1)
    # A hand-checkable chain: 0 -> 1 -> 2 (terminal), reward 1 on reaching 2, one "go" action and one "stay".
    P = torch.zeros(3, 2, 3, dtype=torch.float64)
    P[0, 0, 1] = P[1, 0, 2] = P[2, 0, 2] = 1.0  # go
    P[0, 1, 0] = P[1, 1, 1] = P[2, 1, 2] = 1.0  # stay
    R = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    chain = TabularMDP(P, R, torch.tensor([False, False, True]))
    cases = [
        Case(
            "3-state chain, always go",
            dict(
                V=torch.tensor([0.5, 2.0, 7.0], dtype=torch.float64),
                policy=torch.tensor([[1.0, 0.0]] * 3, dtype=torch.float64),
                mdp=chain,
                gamma=0.9,
            ),
        ),
        Case(
            "3-state chain, go with prob 0.25",
            dict(
                V=torch.tensor([1.0, 2.0, 7.0], dtype=torch.float64),
                policy=torch.tensor([[0.25, 0.75]] * 3, dtype=torch.float64),
                mdp=chain,
                gamma=0.5,
            ),
        ),
    ]
    for i, (S, A, k, gamma) in enumerate([(4, 2, 1, 0.9), (6, 3, 2, 0.99), (10, 4, 3, 1.0), (5, 2, 1, 0.0)]):
        cases.append(
            Case(
                f"random MDP {i + 1}: {S} states, {A} actions, {k} terminal, gamma={gamma}",
                dict(
                    V=torch.randn(S, generator=g, dtype=torch.float64) * 3,
                    policy=_random_policy(S, A, g),
                    mdp=_random_mdp(S, A, k, g),
                    gamma=gamma,
                ),
            )
        )
    return cases


_HINTS_BELLMAN_BACKUP = Hints(
    idea=(
        "A state's new value is what the policy expects to collect from it: average over its actions, "
        "weighted by the policy, of the immediate reward plus the discounted value of where the action leads,"
        " averaged over the transition probabilities. Terminal states are worth nothing."
    ),
    formula="V'(s) = sum_a pi(a|s) [R(s,a) + gamma * sum_s' P(s'|s,a) V(s')], "
    "with V(s') = 0 for terminal s' and V'(s) = 0 for terminal s.",
    solution=_solutions.bellman_backup,
)


@with_hints(_HINTS_BELLMAN_BACKUP)
def check_bellman_backup(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``bellman_backup(V, policy, mdp, gamma)`` (one sweep of policy evaluation)."""
    return run_checker(
        "Exercise 1.2 bellman_backup",
        fn,
        _ref_backup,
        _backup_cases(),
        diagnoses=_BACKUP_DIAGNOSES,
        verbose=verbose,
        hints=_HINTS_BELLMAN_BACKUP,
    )
