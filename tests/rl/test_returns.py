import pytest
import torch

from edurl.rl import discounted_returns

T, F = True, False


def test_single_episode_hand_computed():
    # gamma = 0.5: G_2 = 3, G_1 = 2 + 0.5*3 = 3.5, G_0 = 1 + 0.5*3.5 = 2.75
    out = discounted_returns(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([F, F, F]), 0.5)
    torch.testing.assert_close(out, torch.tensor([2.75, 3.5, 3.0]))


def test_several_episodes_in_one_column_reset():
    # column 0: episode [1, 1] then episode [1, 1]; column 1: [0, 1, 1] ends at t=2 then a cut-off [2]
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 2.0]])
    dones = torch.tensor([[F, F], [T, F], [F, T], [T, F]])
    out = discounted_returns(rewards, dones, 0.9)
    expected = torch.tensor([[1.9, 0.0 + 0.9 * 1.9], [1.0, 1.9], [1.9, 1.0], [1.0, 2.0]])
    torch.testing.assert_close(out, expected)


def test_truncated_rollout_is_not_bootstrapped():
    # The last episode is cut off by the rollout's end: its return is the partial sum, nothing more.
    out = discounted_returns(torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.bool), 1.0)
    torch.testing.assert_close(out, torch.tensor([[3.0], [2.0], [1.0]]))


def test_gamma_zero_and_one():
    r = torch.tensor([[1.0], [2.0], [3.0]])
    d = torch.zeros(3, 1, dtype=torch.bool)
    torch.testing.assert_close(discounted_returns(r, d, 0.0), r)
    torch.testing.assert_close(discounted_returns(r, d, 1), torch.tensor([[6.0], [5.0], [3.0]]))


def _slow_reference(rewards, dones, gamma):
    """Per env, per step: sum gamma^k r_{t+k} until the episode's last step. Independent of the recursion."""
    T, N = rewards.shape
    out = torch.zeros_like(rewards)
    for n in range(N):
        for t in range(T):
            total, k = 0.0, 0
            for u in range(t, T):
                total += gamma**k * rewards[u, n].item()
                k += 1
                if dones[u, n]:
                    break
            out[t, n] = total
    return out


def test_matches_slow_reference_on_random_rollouts():
    g = torch.Generator().manual_seed(0)
    for gamma in (0.0, 0.5, 0.99, 1.0):
        rewards = torch.randn(30, 5, generator=g, dtype=torch.float64)
        dones = torch.rand(30, 5, generator=g) < 0.15
        torch.testing.assert_close(discounted_returns(rewards, dones, gamma), _slow_reference(rewards, dones, gamma))


def test_keeps_dtype_and_does_not_modify_inputs():
    rewards = torch.randn(4, 2, dtype=torch.float64)
    dones = torch.tensor([[F, T], [F, F], [T, F], [F, F]])
    r0, d0 = rewards.clone(), dones.clone()
    out = discounted_returns(rewards, dones, 0.9)
    assert out.dtype == torch.float64 and out.shape == (4, 2)
    assert torch.equal(rewards, r0) and torch.equal(dones, d0)


@pytest.mark.parametrize("gamma", [-0.1, 1.5, float("nan")])
def test_bad_gamma(gamma):
    with pytest.raises(ValueError, match="gamma must be in \\[0, 1\\]"):
        discounted_returns(torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.bool), gamma)


def test_bad_inputs_have_clear_errors():
    ok_r, ok_d = torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.bool)
    with pytest.raises(TypeError, match="rewards must be a torch.Tensor, got ndarray"):
        discounted_returns(ok_r.numpy(), ok_d, 0.9)
    with pytest.raises(TypeError, match="dones must be a bool tensor, got torch.float32"):
        discounted_returns(ok_r, ok_d.float(), 0.9)
    with pytest.raises(TypeError, match="floating-point"):
        discounted_returns(ok_r.long(), ok_d, 0.9)
    with pytest.raises(ValueError, match="same shape"):
        discounted_returns(ok_r, ok_d[:2], 0.9)
    with pytest.raises(ValueError, match="1-D or 2-D"):
        discounted_returns(torch.ones(2, 2, 2), torch.zeros(2, 2, 2, dtype=torch.bool), 0.9)
    with pytest.raises(TypeError, match="gamma must be a number"):
        discounted_returns(ok_r, ok_d, "0.9")


@pytest.mark.cuda
def test_runs_on_cuda():
    rewards = torch.randn(50, 8, dtype=torch.float64)
    dones = torch.rand(50, 8) < 0.1
    out = discounted_returns(rewards.cuda(), dones.cuda(), 0.97)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), discounted_returns(rewards, dones, 0.97))


def test_nothing_after_an_episode_end_flows_back_not_even_a_nan():
    """The end was masked by multiplying with 0, and 0 * inf is nan: a non-finite reward in the next episode
    reached the earlier one. And an empty rollout (T = 0) crashed on rewards[0]."""
    got = discounted_returns(torch.tensor([1.0, float("inf")]), torch.tensor([True, False]), 0.9)
    assert got.tolist() == [1.0, float("inf")]
    got = discounted_returns(torch.tensor([1.0, float("nan")]), torch.tensor([True, False]), 0.0)
    assert got[0].item() == 1.0 and got[1].isnan()
    empty = discounted_returns(torch.zeros(0, 3, dtype=torch.float64), torch.zeros(0, 3, dtype=torch.bool), 0.9)
    assert empty.shape == (0, 3) and empty.dtype == torch.float64
