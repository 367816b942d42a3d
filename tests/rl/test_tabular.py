import gymnasium as gym
import pytest
import torch

from edurl.rl import (
    TabularMDP,
    bellman_backup,
    greedy_policy,
    monte_carlo_value,
    policy_evaluation,
    q_values,
    solve_policy_values,
    uniform_policy,
    value_iteration,
)


def chain_mdp():
    """0 -> 1 -> 2 (terminal). Action 0 moves right, action 1 stays. Reward 1 for entering state 2."""
    P = torch.zeros(3, 2, 3, dtype=torch.float64)
    P[0, 0, 1] = P[1, 0, 2] = P[2, 0, 2] = 1.0
    P[0, 1, 0] = P[1, 1, 1] = P[2, 1, 2] = 1.0
    R = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    return TabularMDP(P, R, torch.tensor([False, False, True]))


@pytest.fixture(scope="module")
def frozen_lake():
    return TabularMDP.from_gymnasium(gym.make("FrozenLake-v1"))


def test_from_gymnasium_reads_frozen_lake(frozen_lake):
    assert frozen_lake.P.shape == (16, 4, 16)
    assert frozen_lake.terminal.nonzero().flatten().tolist() == [5, 7, 11, 12, 15]  # four holes and the goal
    # Slippery: from state 0, "right" (2) goes down, right or up with prob 1/3 each; up from row 0 stays.
    torch.testing.assert_close(frozen_lake.P[0, 2, [0, 1, 4]], torch.full((3,), 1 / 3, dtype=torch.float64))
    # Reward 1 only for entering the goal: from 14 (left of G) "right" reaches it with prob 1/3.
    assert frozen_lake.R[14, 2].item() == pytest.approx(1 / 3)
    # G's other neighbour, 11, is a hole (nothing leaves it), and from 14 three of four actions can slip
    # into G with prob 1/3 each ("left" cannot): the rewards sum to 3 * 1/3 = 1.
    assert frozen_lake.R.sum().item() == pytest.approx(1.0)


def test_backup_hand_computed_on_chain():
    mdp = chain_mdp()
    go = torch.tensor([[1.0, 0.0]] * 3, dtype=torch.float64)
    V = torch.tensor([0.5, 2.0, 7.0], dtype=torch.float64)
    # V'(0) = 0 + 0.9*V(1) = 1.8; V'(1) = 1 + 0.9*0 (2 is terminal) = 1; V'(2) = 0 (terminal)
    torch.testing.assert_close(bellman_backup(V, go, mdp, 0.9), torch.tensor([1.8, 1.0, 0.0], dtype=torch.float64))
    Q = q_values(V, mdp, 0.9)
    torch.testing.assert_close(Q[0], torch.tensor([1.8, 0.45], dtype=torch.float64))


def test_policy_evaluation_matches_linear_solve_and_hand_values():
    mdp = chain_mdp()
    half = torch.full((3, 2), 0.5, dtype=torch.float64)
    # V(1) = 0.5*1 + 0.5*0.9*V(1) -> V(1) = 0.5/0.55; V(0) = 0.5*0.9*V(1) + 0.5*0.9*V(0) -> V(0) = 0.45 V(1) / 0.55
    v1 = 0.5 / 0.55
    expected = torch.tensor([0.45 * v1 / 0.55, v1, 0.0], dtype=torch.float64)
    V, deltas = policy_evaluation(half, mdp, 0.9)
    torch.testing.assert_close(V, expected)
    torch.testing.assert_close(solve_policy_values(half, mdp, 0.9), expected)
    assert deltas[-1] < 1e-10 and deltas[0] > deltas[-1]


def test_policy_evaluation_agrees_with_linear_solve_on_frozen_lake(frozen_lake):
    pi = uniform_policy(frozen_lake)
    for gamma in (0.5, 0.9, 0.99):
        V, _ = policy_evaluation(pi, frozen_lake, gamma)
        torch.testing.assert_close(V, solve_policy_values(pi, frozen_lake, gamma), atol=1e-8, rtol=0)
    # a float32 policy, which policy_evaluation takes and the linear solve refused with a dtype RuntimeError
    pi32 = torch.softmax(torch.randn(pi.shape, generator=torch.Generator().manual_seed(0)), -1)
    V32, _ = policy_evaluation(pi32, frozen_lake, 0.9)
    torch.testing.assert_close(
        solve_policy_values(pi32, frozen_lake, 0.9), V32.to(frozen_lake.P.dtype), atol=1e-6, rtol=0
    )


def test_value_iteration_satisfies_bellman_optimality(frozen_lake):
    V, pi, deltas = value_iteration(frozen_lake, 0.99)
    Q = q_values(V, frozen_lake, 0.99)
    live = ~frozen_lake.terminal
    torch.testing.assert_close(V[live], Q.max(-1).values[live], atol=1e-8, rtol=0)
    # Its greedy policy is at least as good as the uniform one everywhere, and its value is V*.
    torch.testing.assert_close(solve_policy_values(pi, frozen_lake, 0.99), V, atol=1e-6, rtol=0)
    V_uniform = solve_policy_values(uniform_policy(frozen_lake), frozen_lake, 0.99)
    assert (V >= V_uniform - 1e-9).all()
    assert 0.5 < V[0] < 0.6  # a known figure: about 0.54 from the start with gamma = 0.99


@pytest.mark.parametrize("slippery", [False, True])
def test_value_iteration_at_gamma_1_returns_a_policy_that_reaches_the_goal(slippery):
    # undiscounted, a move into a wall ties with a move on; the lowest-index tie-break once walked into the wall
    # for ever from the start of the non-slippery lake (a policy worth 0 where V* is 1)
    mdp = TabularMDP.from_gymnasium(gym.make("FrozenLake-v1", is_slippery=slippery))
    V, pi, _ = value_iteration(mdp, 1.0)
    torch.testing.assert_close(solve_policy_values(pi, mdp, 1.0), V, atol=1e-6, rtol=0)
    assert V[0] > (0.8 if slippery else 0.99)


def test_chain_optimal_policy_is_go():
    V, pi, _ = value_iteration(chain_mdp(), 0.9)
    torch.testing.assert_close(V, torch.tensor([0.9, 1.0, 0.0], dtype=torch.float64))
    assert pi[:2].argmax(-1).tolist() == [0, 0]


def test_monte_carlo_agrees_with_dynamic_programming(frozen_lake):
    V, pi, _ = value_iteration(frozen_lake, 0.95)
    env = gym.make("FrozenLake-v1", max_episode_steps=400)
    mean, stderr = monte_carlo_value(env, pi, 0.95, 600, seed=0, progress=False)
    assert abs(mean - V[0].item()) < 4 * stderr


def test_greedy_policy_is_one_hot_lowest_index_on_ties():
    pi = greedy_policy(torch.tensor([[1.0, 3.0, 3.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(pi, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_bad_inputs_have_clear_errors(frozen_lake):
    mdp = chain_mdp()
    with pytest.raises(ValueError, match="P\\[0, 0, :\\] sums to 2"):
        TabularMDP(mdp.P * 2, mdp.R, mdp.terminal)
    negative = mdp.P.clone()
    negative[0, 0, :2] = torch.tensor([1.5, -0.5], dtype=torch.float64)  # sums to 1: once accepted
    with pytest.raises(ValueError, match="is negative"):
        TabularMDP(negative, mdp.R, mdp.terminal)
    with pytest.raises(ValueError, match="R must have shape"):
        TabularMDP(mdp.P, mdp.R[:2], mdp.terminal)
    with pytest.raises(ValueError, match="policy rows must be probabilities"):
        bellman_backup(torch.zeros(3, dtype=torch.float64), torch.ones(3, 2, dtype=torch.float64), mdp, 0.9)
    with pytest.raises(ValueError, match="V must have shape"):
        q_values(torch.zeros(4, dtype=torch.float64), mdp, 0.9)
    with pytest.raises(ValueError, match="gamma must be in"):
        q_values(torch.zeros(3, dtype=torch.float64), mdp, -0.5)
    stay = torch.tensor([[0.0, 1.0]] * 3, dtype=torch.float64)  # never reaches the terminal state
    with pytest.raises(ValueError, match="no unique solution"):
        solve_policy_values(stay, mdp, 1.0)
    with pytest.raises(RuntimeError, match="did not converge"):
        policy_evaluation(
            torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]], dtype=torch.float64),
            TabularMDP(mdp.P, torch.ones(3, 2, dtype=torch.float64), mdp.terminal),
            1.0,
            max_iters=50,
        )
    with pytest.raises(TypeError, match="no transition table"):
        TabularMDP.from_gymnasium(gym.make("CartPole-v1"))
    env, pi = gym.make("FrozenLake-v1", max_episode_steps=20), torch.full((16, 4), 0.25, dtype=torch.float64)
    for bad in (1, 2.0, None, True):  # 2.0 failed in np.empty, None in a comparison, each with torch's words
        with pytest.raises(ValueError, match=f"num_episodes must be a whole number >= 2 .*got {bad!r}"):
            monte_carlo_value(env, pi, 0.9, bad, progress=False)


def test_a_float32_value_vector_works_on_a_float64_mdp():
    """V = torch.zeros(S), as a learner writes it, crashed q_values and bellman_backup inside torch.einsum
    ("expected scalar type Double but found Float") on an MDP in float64."""
    mdp = chain_mdp()
    q32 = q_values(torch.zeros(3), mdp, 0.9)
    assert torch.equal(q32, q_values(torch.zeros(3, dtype=torch.float64), mdp, 0.9)) and q32.dtype == torch.float64
    V = bellman_backup(torch.zeros(3), uniform_policy(mdp).float(), mdp, 0.9)
    assert V.tolist() == [0.0, 0.5, 0.0]


def test_bad_rewards_and_sweep_limits_are_named():
    """A NaN reward was accepted (every value then came out NaN), and max_iters=0 raised an IndexError from inside
    the loop instead of saying what was wrong."""
    mdp = chain_mdp()
    R = mdp.R.clone()
    R[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"R\[1, 0\] = nan"):
        TabularMDP(mdp.P, R, mdp.terminal)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="max_iters must be a whole number"):
            policy_evaluation(uniform_policy(mdp), mdp, 0.9, max_iters=bad)
        with pytest.raises(ValueError, match="max_iters must be a whole number"):
            value_iteration(mdp, 0.9, max_iters=bad)
