"""Each Chapter 1 checker passes the reference and the worked solution, and rejects realistic buggy versions,
written the way a learner might write them (plain loops), with the hint that names the mistake."""

import pytest
import torch

from edurl import exercises
from edurl.exercises import NOT_ATTEMPTED, PASSED
from edurl.exercises.solutions import ch01 as solutions
from edurl.rl import bellman_backup, discounted_returns

from .conftest import assert_rejected

# ---------------------------------------------------------------- Exercise 1.1: discounted_returns


def returns_loop_no_reset(rewards, dones, gamma):
    out, g = torch.zeros_like(rewards), torch.zeros_like(rewards[0])
    for t in reversed(range(len(rewards))):
        g = rewards[t] + gamma * g  # forgets the episode boundaries
        out[t] = g
    return out


def returns_reset_after_storing(rewards, dones, gamma):
    out, g = torch.zeros_like(rewards), torch.zeros_like(rewards[0])
    for t in reversed(range(len(rewards))):
        g = rewards[t] + gamma * g
        out[t] = g
        g = g * (~dones[t])  # off by one: resets after the episode's last step was already stored
    return out


def returns_forward_cumsum(rewards, dones, gamma):
    out, g = torch.zeros_like(rewards), torch.zeros_like(rewards[0])
    for t in range(len(rewards)):  # wrong direction: return-so-far, not reward-to-go
        g = rewards[t] + gamma * g
        out[t] = g
        g = torch.where(dones[t], torch.zeros_like(g), g)
    return out


def returns_no_gamma(rewards, dones, gamma):
    out, g = torch.zeros_like(rewards), torch.zeros_like(rewards[0])
    for t in reversed(range(len(rewards))):
        g = rewards[t] + g * (~dones[t])  # forgets to discount: every later reward counts in full
        out[t] = g
    return out


def returns_float32_always(rewards, dones, gamma):
    out, g = torch.zeros(rewards.shape), torch.zeros(rewards.shape[1:])  # drops the input's dtype
    for t in reversed(range(len(rewards))):
        g = rewards[t] + gamma * g * (~dones[t])
        out[t] = g
    return out


def returns_in_place(rewards, dones, gamma):
    for t in reversed(range(len(rewards) - 1)):
        rewards[t] += gamma * rewards[t + 1] * (~dones[t])  # overwrites the caller's rewards
    return rewards


@pytest.mark.parametrize("fn", [discounted_returns, solutions.discounted_returns])
def test_returns_checker_passes_correct_versions(fn):
    verdict = exercises.check_discounted_returns(fn, verbose=False)
    assert verdict.status == PASSED, verdict.message
    assert verdict.implementation is fn


@pytest.mark.parametrize(
    "buggy, message",
    [
        (returns_loop_no_reset, "flow across episode boundaries"),
        (returns_reset_after_storing, "off by one"),
        (returns_forward_cumsum, "before* each step"),
        (returns_no_gamma, "gamma seems unused"),
        (returns_float32_always, "expected dtype torch.float64"),
        (returns_in_place, "changed its input `rewards` in place"),
    ],
)
def test_returns_checker_rejects_buggy_versions(buggy, message):
    verdict = assert_rejected(exercises.check_discounted_returns, buggy, message)
    assert verdict.implementation is discounted_returns  # the notebook carries on with the reference


def test_returns_checker_shows_first_failing_case(capsys):
    exercises.check_discounted_returns(returns_loop_no_reset)
    out = capsys.readouterr().out
    assert "❌" in out and "Case 'two episodes in one column'" in out
    assert "expected:" in out and "got:" in out and "Traceback" not in out


# ---------------------------------------------------------------- Exercise 1.2: bellman_backup


def backup_loops_no_terminal(V, policy, mdp, gamma):
    S, A = policy.shape
    out = torch.zeros_like(V)
    for s in range(S):
        for a in range(A):
            out[s] += policy[s, a] * (mdp.R[s, a] + gamma * (mdp.P[s, a] * V).sum())  # bootstraps from terminals
    return out


def backup_loops_max(V, policy, mdp, gamma):
    S, A = policy.shape
    out = torch.zeros_like(V)
    V = torch.where(mdp.terminal, 0.0, V)
    for s in range(S):
        if not mdp.terminal[s]:
            out[s] = max(mdp.R[s, a] + gamma * (mdp.P[s, a] * V).sum() for a in range(A))  # optimality, not pi
    return out


def backup_ignores_policy(V, policy, mdp, gamma):
    V = torch.where(mdp.terminal, 0.0, V)
    Q = mdp.R + gamma * mdp.P @ V
    return torch.where(mdp.terminal, 0.0, Q.mean(1))


def backup_discounts_reward(V, policy, mdp, gamma):
    V = torch.where(mdp.terminal, 0.0, V)
    out = (policy * gamma * (mdp.R + mdp.P @ V)).sum(1)
    return torch.where(mdp.terminal, 0.0, out)


def backup_wrong_axis(V, policy, mdp, gamma):
    V = torch.where(mdp.terminal, 0.0, V)
    expected_next = (mdp.P * V[:, None, None]).sum(0).T  # sums over the *source* state, then fixes the shape
    out = (policy * (mdp.R + gamma * expected_next)).sum(1)
    return torch.where(mdp.terminal, 0.0, out)


def backup_terminal_not_zeroed(V, policy, mdp, gamma):
    V = torch.where(mdp.terminal, 0.0, V)
    return (policy * (mdp.R + gamma * mdp.P @ V)).sum(1)  # masks V(s') but a terminal s keeps a value


def backup_terminal_keeps_V(V, policy, mdp, gamma):
    out = backup_terminal_not_zeroed(V, policy, mdp, gamma)
    return torch.where(mdp.terminal, V, out)  # a terminal s keeps its old value


@pytest.mark.parametrize("fn", [bellman_backup, solutions.bellman_backup])
def test_backup_checker_passes_correct_versions(fn):
    verdict = exercises.check_bellman_backup(fn, verbose=False)
    assert verdict.status == PASSED, verdict.message


@pytest.mark.parametrize(
    "buggy, message",
    [
        (backup_loops_no_terminal, "bootstrap from terminal states"),
        (backup_loops_max, "took the max over actions"),
        (backup_ignores_policy, "averaged over actions uniformly"),
        (backup_discounts_reward, "immediate reward is not discounted"),
        (backup_wrong_axis, "wrong axis of P"),
        (backup_terminal_not_zeroed, "a terminal state itself must get V'(s) = 0"),
        (backup_terminal_keeps_V, "a terminal state itself must get V'(s) = 0"),
    ],
)
def test_backup_checker_rejects_buggy_versions(buggy, message):
    assert_rejected(exercises.check_bellman_backup, buggy, message)


def test_stubs_are_not_attempted():
    def stub(*args):
        raise NotImplementedError

    for check in (exercises.check_discounted_returns, exercises.check_bellman_backup):
        verdict = check(stub, verbose=False)
        assert verdict.status == NOT_ATTEMPTED and not verdict


def test_show_solution_prints_source(capsys):
    source = exercises.show_solution("discounted_returns")
    assert "def discounted_returns" in source and "def discounted_returns" in capsys.readouterr().out
    with pytest.raises(KeyError, match="bellman_backup"):
        exercises.show_solution("bellman")


def test_exercise_1_2_text_asks_for_the_dtype_of_v():
    """The checker feeds float64 values and demands their dtype back; a loop from torch.zeros(S) failed with "expected
    dtype torch.float64" that the exercise's text never asked for (1.1 and 7.1 say it)."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cells = json.loads((root / "notebooks/01_rl_fundamentals.ipynb").read_text())["cells"]
    (text,) = ["".join(c["source"]) for c in cells if "".join(c["source"]).startswith("### Exercise 1.2")]
    (item,) = [
        line for line in (root / "chapters/01_rl_fundamentals.md").read_text().splitlines() if "**One Bellman" in line
    ]
    for where in (text, item):
        assert "same dtype as `V`" in where and "torch.zeros_like(V)" in where, where
