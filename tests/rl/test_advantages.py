import pytest
import torch

from edurl.rl import discounted_returns, gae, td_errors

T, F = True, False


def _slow_gae(rewards, values, next_values, terminated, truncated, gamma, lam):
    """Independent reference: A_t = sum_k (gamma*lam)^k delta_{t+k}, summed until the episode's last step."""
    Tn, N = rewards.shape
    delta = [
        [
            rewards[t, n].item()
            + gamma * next_values[t, n].item() * (0.0 if terminated[t, n] else 1.0)
            - values[t, n].item()
            for n in range(N)
        ]
        for t in range(Tn)
    ]
    out = torch.zeros_like(rewards)
    for n in range(N):
        for t in range(Tn):
            total = 0.0
            for k, u in enumerate(range(t, Tn)):
                total += (gamma * lam) ** k * delta[u][n]
                if terminated[u, n] or truncated[u, n]:
                    break
            out[t, n] = total
    return out


def test_td_errors_hand_computed():
    # delta = r + gamma * V' * (1 - term) - V
    r = torch.tensor([[1.0], [1.0], [1.0]])
    v = torch.tensor([[2.0], [3.0], [4.0]])
    nv = torch.tensor([[3.0], [4.0], [5.0]])
    term = torch.tensor([[F], [F], [T]])
    out = td_errors(r, v, nv, term, 0.5)
    torch.testing.assert_close(out, torch.tensor([[1 + 1.5 - 2], [1 + 2.0 - 3], [1 + 0.0 - 4]]))


def test_gae_truncation_in_the_middle_bootstraps_and_stops():
    # gamma = lam = 1, V = 0 on s_t. Step 1 is truncated: V(final obs) = 10 is bootstrapped there,
    # and the advantage of step 0 sees it through step 1, but nothing from step 2 (a new episode).
    r = torch.tensor([[1.0], [1.0], [1.0]])
    v = torch.zeros(3, 1)
    nv = torch.tensor([[0.0], [10.0], [5.0]])
    term = torch.tensor([[F], [F], [F]])
    trunc = torch.tensor([[F], [T], [F]])
    adv, ret = gae(r, v, nv, term, trunc, 1.0, 1.0)
    # deltas: [1 + 0, 1 + 10, 1 + 5] = [1, 11, 6]; A_2 = 6; A_1 = 11 (episode ended); A_0 = 1 + 11 = 12
    torch.testing.assert_close(adv, torch.tensor([[12.0], [11.0], [6.0]]))
    torch.testing.assert_close(ret, adv + v)


def test_gae_termination_does_not_bootstrap():
    r = torch.tensor([[1.0], [1.0]])
    v = torch.tensor([[0.5], [0.5]])
    nv = torch.tensor([[0.5], [100.0]])  # V(s_2) is garbage: s_2 is terminal, so it must be ignored
    adv, _ = gae(r, v, nv, torch.tensor([[F], [T]]), torch.tensor([[F], [F]]), 0.9, 0.8)
    d1 = 1 - 0.5  # terminal: no bootstrap
    d0 = 1 + 0.9 * 0.5 - 0.5
    torch.testing.assert_close(adv, torch.tensor([[d0 + 0.9 * 0.8 * d1], [d1]]))


def test_gae_several_episodes_in_one_column_and_mixed_columns():
    # column 0: terminates at t=1, new episode runs to the end of the rollout (bootstrapped by next_values[3])
    # column 1: truncated at t=2, then a fresh episode at t=3
    r = torch.tensor([[1.0, 2.0], [2.0, 0.0], [0.5, 1.0], [1.0, 1.0]])
    v = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8]])
    nv = torch.tensor([[0.3, 0.4], [9.0, 0.6], [0.7, 3.0], [2.0, 1.5]])
    term = torch.tensor([[F, F], [T, F], [F, F], [F, F]])
    trunc = torch.tensor([[F, F], [F, F], [F, T], [F, F]])
    g, lam = 0.9, 0.5
    d = r + g * nv * (~term) - v
    gl = g * lam
    expected = torch.stack(
        [
            torch.stack([d[0, 0] + gl * d[1, 0], d[1, 0], d[2, 0] + gl * d[3, 0], d[3, 0]]),
            torch.stack([d[0, 1] + gl * d[1, 1] + gl**2 * d[2, 1], d[1, 1] + gl * d[2, 1], d[2, 1], d[3, 1]]),
        ],
        dim=1,
    )
    adv, ret = gae(r, v, nv, term, trunc, g, lam)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + v)
    # the garbage-looking next_values[1, 0] = 9 is behind a termination: it must not matter
    nv2 = nv.clone()
    nv2[1, 0] = -1000.0
    torch.testing.assert_close(gae(r, v, nv2, term, trunc, g, lam)[0], adv)


def test_gae_matches_slow_reference_on_random_rollouts():
    g = torch.Generator().manual_seed(0)
    for gamma, lam in [(0.99, 0.95), (0.9, 0.0), (1.0, 1.0), (0.5, 0.7)]:
        shape = (40, 6)
        r = torch.randn(shape, generator=g, dtype=torch.float64)
        v = torch.randn(shape, generator=g, dtype=torch.float64)
        nv = torch.randn(shape, generator=g, dtype=torch.float64)
        term = torch.rand(shape, generator=g) < 0.1
        trunc = (torch.rand(shape, generator=g) < 0.1) & ~term
        adv, _ = gae(r, v, nv, term, trunc, gamma, lam)
        torch.testing.assert_close(adv, _slow_gae(r, v, nv, term, trunc, gamma, lam))


def test_lambda_zero_is_td_and_lambda_one_is_monte_carlo():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(20, 3, generator=g)
    v = torch.randn(20, 3, generator=g)
    nv = torch.randn(20, 3, generator=g)
    term = torch.rand(20, 3, generator=g) < 0.15
    no_trunc = torch.zeros(20, 3, dtype=torch.bool)
    adv0, _ = gae(r, v, nv, term, no_trunc, 0.9, 0.0)
    torch.testing.assert_close(adv0, td_errors(r, v, nv, term, 0.9))
    # lambda = 1, every episode terminated inside the rollout and nothing to bootstrap at the end:
    # the sum telescopes (next_values[t] = values[t+1] inside an episode), so advantages + V = the
    # plain discounted return
    term[-1] = True
    nv[:-1] = v[1:]
    _, ret1 = gae(r, v, nv, term, no_trunc, 0.9, 1.0)
    torch.testing.assert_close(ret1, discounted_returns(r, term, 0.9), atol=1e-5, rtol=1e-5)


def test_bad_inputs():
    ok = torch.zeros(3, 2)
    b = torch.zeros(3, 2, dtype=torch.bool)
    with pytest.raises(TypeError, match="terminated must be a bool tensor"):
        gae(ok, ok, ok, ok, b, 0.9, 0.9)
    with pytest.raises(ValueError, match="rewards and next_values must have the same shape"):
        gae(ok, ok, ok[:2], b, b, 0.9, 0.9)
    with pytest.raises(ValueError, match="lam must be in \\[0, 1\\]"):
        gae(ok, ok, ok, b, b, 0.9, 1.5)
    with pytest.raises(ValueError, match="gamma must be in"):
        td_errors(ok, ok, ok, b, -1)
    # None where a mask belongs: named, with the all-False mask to pass instead
    with pytest.raises(TypeError, match=r"truncated is None; .*zeros_like\(rewards, dtype=torch.bool\) if no time"):
        gae(ok, ok, ok, b, None, 0.9, 0.9)
    with pytest.raises(TypeError, match=r"terminated is None; .*if no step reached an end state"):
        td_errors(ok, ok, ok, None, 0.9)
    with pytest.raises(TypeError, match="terminated is None"):
        gae(ok, ok, ok, None, b, 0.9, 0.9)


@pytest.mark.cuda
def test_gae_on_cuda():
    g = torch.Generator().manual_seed(2)
    r, v, nv = (torch.randn(16, 4, generator=g) for _ in range(3))
    term = torch.rand(16, 4, generator=g) < 0.1
    trunc = torch.rand(16, 4, generator=g) < 0.1
    cpu = gae(r, v, nv, term, trunc, 0.99, 0.95)
    gpu = gae(r.cuda(), v.cuda(), nv.cuda(), term.cuda(), trunc.cuda(), 0.99, 0.95)
    assert gpu[0].device.type == "cuda"
    torch.testing.assert_close(gpu[0].cpu(), cpu[0])
    torch.testing.assert_close(
        td_errors(r.cuda(), v.cuda(), nv.cuda(), term.cuda(), 0.9).cpu(), td_errors(r, v, nv, term, 0.9)
    )


def test_an_end_states_value_counts_as_zero_even_when_the_critic_says_nan():
    """A terminal next value was multiplied by 0, and 0 * nan is nan: a critic's non-finite value at a terminal
    final observation made the TD error and every advantage of its episode nan. A nan in the next episode
    crossed the episode end the same way. An empty rollout crashed."""
    one = torch.tensor
    assert td_errors(one([1.0]), one([0.5]), one([float("nan")]), one([True]), 0.99).tolist() == [0.5]
    adv, ret = gae(
        one([1.0, 2.0]), one([0.0, 0.0]), one([float("inf"), float("nan")]), one([True, False]), one([False, False]),
        0.99, 0.95,
    )  # fmt: skip
    assert adv[0].item() == 1.0 and adv[1].isnan() and ret[0].item() == 1.0
    adv, _ = gae(one([1.0, float("nan")]), *(torch.zeros(2),) * 2, one([True, False]), one([False, False]), 1.0, 1.0)
    assert adv[0].item() == 1.0
    z = torch.zeros(0, 2)
    adv, ret = gae(z, z, z, z.bool(), z.bool(), 0.9, 0.9)
    assert adv.shape == ret.shape == (0, 2)
