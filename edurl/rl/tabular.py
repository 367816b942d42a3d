"""Dynamic programming on small MDPs whose transition table we know: Chapter 1.

An MDP here is three tensors (S states, A actions):

==========  =========  ================================================================
field       shape      meaning
==========  =========  ================================================================
P           (S, A, S)  P[s, a, s'] = probability of moving to s' after action a in s
R           (S, A)     expected immediate reward for action a in s: sum_s' P * r(s, a, s')
terminal    (S,)       bool; arriving in a terminal state ends the episode, so V = 0 there
==========  =========  ================================================================

A policy is an ``(S, A)`` tensor of action probabilities; each row sums to 1.

The Bellman expectation equation for a policy pi (Sutton & Barto, 2018, eq. 4.4)::

    V(s) = sum_a pi(a|s) [ R(s, a) + gamma * sum_s' P(s'|s, a) * V(s') ],   V(terminal) = 0

``bellman_backup`` applies its right-hand side once; ``policy_evaluation`` repeats it until V stops
moving; ``solve_policy_values`` solves the same linear system directly, as an independent check;
``value_iteration`` replaces the policy average by a max (the Bellman optimality equation, eq. 4.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from edurl._checks import check_count, check_gamma, check_tensor, is_whole
from edurl.utils import progress as progress_bar

__all__ = [
    "TabularMDP",
    "q_values",
    "bellman_backup",
    "policy_evaluation",
    "solve_policy_values",
    "value_iteration",
    "greedy_policy",
    "uniform_policy",
    "monte_carlo_value",
]


@dataclass
class TabularMDP:
    """A finite MDP as dense tensors (float64), plus what plots need to draw a grid world."""

    P: torch.Tensor
    """(S, A, S) transition probabilities."""
    R: torch.Tensor
    """(S, A) expected immediate rewards."""
    terminal: torch.Tensor
    """(S,) bool, True for states where the episode has ended."""
    grid: np.ndarray | None = None
    """(rows, cols) array of map letters for grid worlds (FrozenLake: S, F, H, G), else None."""
    action_names: tuple[str, ...] | None = None
    """Names of the actions, in index order, e.g. ("left", "down", "right", "up")."""

    def __post_init__(self):
        check_tensor(self.P, "P", ndim=(3,), floating=True)
        S, A, S2 = self.P.shape
        if S != S2:
            raise ValueError(f"P must have shape (S, A, S), got {tuple(self.P.shape)}.")
        check_tensor(self.R, "R", ndim=(2,), floating=True)
        if tuple(self.R.shape) != (S, A):
            raise ValueError(f"R must have shape (S, A) = {(S, A)}, got {tuple(self.R.shape)}.")
        if not torch.isfinite(self.R).all():
            s, a = (int(x) for x in (~torch.isfinite(self.R)).nonzero()[0])
            raise ValueError(f"R[{s}, {a}] = {self.R[s, a].item()}; every expected reward must be a finite number.")
        check_tensor(self.terminal, "terminal", ndim=(1,), boolean=True)
        if self.terminal.shape[0] != S:
            raise ValueError(f"terminal must have shape (S,) = ({S},), got {tuple(self.terminal.shape)}.")
        if (self.P < 0).any():
            s, a, s2 = (int(x) for x in (self.P < 0).nonzero()[0])
            raise ValueError(f"P[{s}, {a}, {s2}] = {self.P[s, a, s2].item():.6g} is negative; probabilities are >= 0.")
        row_sums = self.P.sum(-1)
        if not torch.allclose(row_sums, torch.ones_like(row_sums), atol=1e-6):
            s, a = divmod(int((row_sums - 1).abs().argmax()), A)
            raise ValueError(f"P[{s}, {a}, :] sums to {row_sums[s, a].item():.6f}; every P[s, a, :] must sum to 1.")

    def __repr__(self) -> str:
        S, A = self.num_states, self.num_actions
        head = f"TabularMDP(S={S}, A={A}, terminal states {self.terminal.nonzero().flatten().tolist()})"
        if S > 6:
            return head
        lines = [head]
        for s in range(S):
            for a in range(A):
                moves = {t: round(p, 4) for t, p in enumerate(self.P[s, a].tolist()) if p > 0}
                lines.append(f"  s={s} a={a}: R={self.R[s, a].item():.4g}, next state probabilities {moves}")
        return "\n".join(lines)

    @property
    def num_states(self) -> int:
        return self.P.shape[0]

    @property
    def num_actions(self) -> int:
        return self.P.shape[1]

    @classmethod
    def from_gymnasium(cls, env) -> TabularMDP:
        """Read the transition table ``env.unwrapped.P`` of a toy-text env (FrozenLake, CliffWalking). Taxi publishes
        one too, but its episode ends by the transition into a state, not by the state (a passenger dropped off at
        a stand ends it; driving onto the same stand does not), which a TabularMDP cannot say: it is refused.

        ``P[s][a]`` there is a list of ``(prob, next_state, reward, terminated)``. A state counts as
        terminal when the transitions into it end the episode.
        """
        table = getattr(env.unwrapped, "P", None)
        if not isinstance(table, dict):
            raise TypeError(
                f"{env.unwrapped.__class__.__name__} has no transition table env.unwrapped.P; "
                "gymnasium's toy-text envs (FrozenLake, CliffWalking) publish one."
            )
        S, A = env.observation_space.n, env.action_space.n
        # filled entry by entry from the env's Python table, so built on the host
        P = torch.zeros(S, A, S, dtype=torch.float64, device="cpu")
        R = torch.zeros(S, A, dtype=torch.float64, device="cpu")
        ends = torch.zeros(S, dtype=torch.bool, device="cpu")
        continues = torch.zeros(S, dtype=torch.bool, device="cpu")
        for s in range(S):
            for a in range(A):
                for prob, s_next, reward, terminated in table[s][a]:
                    P[s, a, s_next] += prob
                    R[s, a] += prob * reward
                    if prob > 0:
                        (ends if terminated else continues)[s_next] = True
        mixed = ends & continues
        if mixed.any():
            raise ValueError(
                f"states {mixed.nonzero().flatten().tolist()} end the episode on some transitions and not on others; "
                "TabularMDP needs termination to depend on the state reached."
            )
        grid = None
        if hasattr(env.unwrapped, "desc"):
            grid = np.asarray(env.unwrapped.desc).astype(str)
        names = (
            ("left", "down", "right", "up") if env.spec is not None and env.spec.id.startswith("FrozenLake") else None
        )
        return cls(P, R, ends, grid, names)


def _check_values(V: torch.Tensor, mdp: TabularMDP) -> None:
    check_tensor(V, "V", ndim=(1,), floating=True)
    if V.shape[0] != mdp.num_states:
        raise ValueError(f"V must have shape (S,) = ({mdp.num_states},), got {tuple(V.shape)}.")


def _check_policy(policy: torch.Tensor, mdp: TabularMDP) -> None:
    check_tensor(policy, "policy", ndim=(2,), floating=True)
    if tuple(policy.shape) != (mdp.num_states, mdp.num_actions):
        raise ValueError(
            f"policy must have shape (S, A) = {(mdp.num_states, mdp.num_actions)}, got {tuple(policy.shape)}."
        )
    sums = policy.sum(-1)
    if (policy < 0).any() or not torch.allclose(sums, torch.ones_like(sums), atol=1e-6):
        raise ValueError("policy rows must be probabilities: non-negative and summing to 1 over actions.")


def q_values(V: torch.Tensor, mdp: TabularMDP, gamma: float) -> torch.Tensor:
    """One-step lookahead: ``Q(s, a) = R(s, a) + gamma * sum_s' P(s'|s, a) * V(s') * (1 - terminal(s'))``. Shape (S, A)."""
    _check_values(V, mdp)
    gamma = check_gamma(gamma)
    V = V.to(mdp.P.dtype)  # a float32 V (torch.zeros(S)) against the MDP's float64, as solve_policy_values does
    V_next = V.masked_fill(mdp.terminal, 0.0)  # nothing is collected after an episode ends
    return mdp.R + gamma * torch.einsum("sat,t->sa", mdp.P, V_next)  # (S, A)


def bellman_backup(V: torch.Tensor, policy: torch.Tensor, mdp: TabularMDP, gamma: float) -> torch.Tensor:
    """Apply the Bellman expectation equation once: V'(s) = sum_a pi(a|s) Q(s, a), and V' = 0 on terminal states.

    ``V`` (S,), ``policy`` (S, A); returns V' (S,). Chapter 1, exercise 2.
    """
    _check_policy(policy, mdp)
    V_new = (policy * q_values(V, mdp, gamma)).sum(-1)  # (S,)
    return V_new.masked_fill(mdp.terminal, 0.0)


def policy_evaluation(
    policy: torch.Tensor, mdp: TabularMDP, gamma: float, *, tol: float = 1e-10, max_iters: int = 100_000
) -> tuple[torch.Tensor, list[float]]:
    """Iterate ``bellman_backup`` from V = 0 until ``max |V' - V| < tol``.

    Returns V (S,) and the list of those max changes, one per sweep, to plot convergence.
    Raises ``RuntimeError`` if it has not converged after ``max_iters`` sweeps (with gamma = 1 that
    happens for a policy that can wander forever without reaching a terminal state).
    """
    check_count(max_iters, "max_iters", "sweeps")
    V = torch.zeros(mdp.num_states, dtype=mdp.P.dtype, device=mdp.P.device)
    deltas = []
    for _ in range(max_iters):
        V_new = bellman_backup(V, policy, mdp, gamma)
        deltas.append((V_new - V).abs().max().item())
        V = V_new
        if deltas[-1] < tol:
            return V, deltas
    raise RuntimeError(
        f"policy evaluation did not converge in {max_iters} sweeps (last change {deltas[-1]:.3g}). "
        "With gamma = 1 the policy must reach a terminal state from every state; try gamma < 1."
    )


def solve_policy_values(policy: torch.Tensor, mdp: TabularMDP, gamma: float) -> torch.Tensor:
    """V for a policy from the linear system (I - gamma * P_pi * M) V = R_pi, with M masking terminal states.

    The exact solution that ``policy_evaluation`` converges to, found without iterating. Shape (S,).
    """
    _check_policy(policy, mdp)
    gamma = check_gamma(gamma)
    policy = policy.to(mdp.P.dtype)  # a float32 policy (a softmax of float32 logits) against the MDP's float64
    P_pi = torch.einsum("sa,sat->st", policy, mdp.P)  # (S, S)
    R_pi = (policy * mdp.R).sum(-1)  # (S,)
    live = (~mdp.terminal).to(P_pi.dtype)
    eye = torch.eye(mdp.num_states, dtype=P_pi.dtype, device=P_pi.device)
    A = eye - gamma * P_pi * live[None, :]
    b = R_pi * live
    A[mdp.terminal] = eye[mdp.terminal]  # rows "V(terminal) = 0"
    if torch.linalg.matrix_rank(A) < mdp.num_states:
        raise ValueError(
            "the Bellman system has no unique solution: with gamma = 1 some states never reach a terminal state "
            "under this policy. Use gamma < 1."
        )
    return torch.linalg.solve(A, b)


def greedy_policy(Q: torch.Tensor) -> torch.Tensor:
    """The deterministic policy that picks argmax_a Q(s, a) (lowest index on ties), as one-hot (S, A)."""
    check_tensor(Q, "Q", ndim=(2,), floating=True)
    return torch.nn.functional.one_hot(Q.argmax(-1), Q.shape[-1]).to(Q.dtype)


def uniform_policy(mdp: TabularMDP) -> torch.Tensor:
    """Every action equally likely in every state: (S, A) filled with 1/A."""
    return torch.full((mdp.num_states, mdp.num_actions), 1.0 / mdp.num_actions, dtype=mdp.P.dtype, device=mdp.P.device)


def value_iteration(
    mdp: TabularMDP, gamma: float, *, tol: float = 1e-10, max_iters: int = 100_000
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Iterate V(s) <- max_a Q(s, a) (Bellman optimality) from V = 0 until ``max |V' - V| < tol``.

    Returns V* (S,), the greedy policy for V* as one-hot (S, A), and the max change per sweep.
    """
    check_count(max_iters, "max_iters", "sweeps")
    V = torch.zeros(mdp.num_states, dtype=mdp.P.dtype, device=mdp.P.device)
    deltas = []
    for _ in range(max_iters):
        V_new = q_values(V, mdp, gamma).max(-1).values.masked_fill(mdp.terminal, 0.0)
        deltas.append((V_new - V).abs().max().item())
        V = V_new
        if deltas[-1] < tol:
            Q = q_values(V, mdp, gamma)
            return V, greedy_policy(Q) if gamma < 1 else _quickest_of_the_best(Q, mdp), deltas
    raise RuntimeError(
        f"value iteration did not converge in {max_iters} sweeps (last change {deltas[-1]:.3g}); try gamma < 1."
    )


def _quickest_of_the_best(Q: torch.Tensor, mdp: TabularMDP, tie: float = 1e-8, sweeps: int = 10_000) -> torch.Tensor:
    """The greedy policy for an undiscounted Q, ties broken toward the fewest expected steps to a terminal state.

    With gamma = 1 a step costs nothing, so bumping into a wall ties with moving on (both worth V*), and the
    lowest-index tie-break once picked the wall for ever: a policy worth 0, not V*. Among the actions within
    ``tie`` of the best, this one minimises the expected steps to the end (value iteration on the steps)."""
    best = Q >= Q.max(-1, keepdim=True).values - tie  # (S, A)
    steps = torch.zeros(mdp.num_states, dtype=Q.dtype, device=Q.device)
    for _ in range(sweeps):
        cost = torch.where(best, 1.0 + mdp.P @ steps, torch.inf)  # (S, A)
        new = cost.min(-1).values.masked_fill(mdp.terminal, 0.0)
        if (new - steps).abs().max() < 1e-9:
            break
        steps = new
    return torch.nn.functional.one_hot(cost.argmin(-1), Q.shape[-1]).to(Q.dtype)


def monte_carlo_value(
    env, policy: torch.Tensor, gamma: float, num_episodes: int, *, seed: int = 0, progress: bool = True
) -> tuple[float, float]:
    """Estimate V(start) by running ``policy`` in a real gymnasium env: mean discounted return and its standard error.

    An independent check on dynamic programming: the same number measured by playing episodes, not by
    solving equations. Episodes cut off by the env's time limit count with the return they collected,
    so give the env a time limit long enough for gamma**limit to be negligible.
    """
    gamma = check_gamma(gamma)
    if not is_whole(num_episodes) or num_episodes < 2:
        raise ValueError(  # 2.0 failed in np.empty, None in the comparison
            f"num_episodes must be a whole number >= 2 to estimate a standard error, got {num_episodes!r}."
        )
    rng = np.random.default_rng(seed)
    probs = policy.detach().cpu().numpy()
    returns = np.empty(num_episodes)
    for i in progress_bar(range(num_episodes), desc="Monte Carlo episodes", disable=not progress):
        state, _ = env.reset(seed=seed + i)
        G, discount, done = 0.0, 1.0, False
        while not done:
            action = rng.choice(probs.shape[1], p=probs[state])
            state, reward, terminated, truncated, _ = env.step(action)
            G += discount * reward
            discount *= gamma
            done = terminated or truncated
        returns[i] = G
    return float(returns.mean()), float(returns.std(ddof=1) / np.sqrt(num_episodes))
