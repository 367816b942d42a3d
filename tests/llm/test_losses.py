import math
import statistics

import pytest
import torch

from edurl.llm import losses as L
from edurl.llm.losses import (
    AGGREGATION_MODES,
    LOSS_FNS,
    aggregate,
    cispo,
    clip_fraction,
    dro,
    drop_zero_variance_groups,
    get_loss_fn,
    group_advantages,
    importance_sampling,
    kl,
    kl_penalty_advantages,
    loss_fn_defaults,
    ppo,
    zero_variance_groups,
)

F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def exact_log(r: float) -> float:
    """A float x with torch.exp(x) == r bit for bit, so a test can put a ratio exactly on a clip boundary."""
    x = torch.tensor([math.log(r)], dtype=F64)
    for _ in range(50):
        got = torch.exp(x).item()
        if got == r:
            return x.item()
        x = torch.nextafter(x, torch.tensor([-math.inf if got > r else math.inf], dtype=F64))
    raise AssertionError(f"no float64 x with exp(x) == {r}")


def loss_and_grad(fn, logprobs, *args, **kwargs):
    """Per-token loss and d(sum of loss)/d(logprobs), both detached."""
    lp = logprobs.clone().requires_grad_(True)
    loss = fn(lp, *args, **kwargs)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    return loss.detach(), grad


# ---------------------------------------------------------------- importance_sampling


def test_importance_sampling_hand_computed():
    # r = [2, 1, 0.5], A = [1, -2, 3]: loss = -r*A = [-2, 2, -1.5]; d/d lp of -exp(lp - q)*A is -r*A again
    lp, q, adv = t(math.log(2) - 1.0, -0.3, math.log(0.5) + 0.2), t(-1.0, -0.3, 0.2), t(1.0, -2.0, 3.0)
    loss, grad = loss_and_grad(importance_sampling, lp, q, adv)
    torch.testing.assert_close(loss, t(-2.0, 2.0, -1.5))
    torch.testing.assert_close(grad, t(-2.0, 2.0, -1.5))


# ---------------------------------------------------------------- ppo at and around the clip boundaries

UP, DOWN = 1 + 1e-6, 1 - 1e-6  # just above / just below a boundary


@pytest.mark.parametrize(
    "r, adv, clipped_to",
    [
        # on the boundary: still inside, the gradient flows
        (1.2, 2.0, None),
        (1.2, -2.0, None),
        (0.8, 2.0, None),
        (0.8, -2.0, None),
        # just inside
        (1.2 * DOWN, 2.0, None),
        (1.2 * DOWN, -2.0, None),
        (0.8 * UP, 2.0, None),
        (0.8 * UP, -2.0, None),
        # just outside: the clip binds only where it is pessimistic (A > 0 above hi, A < 0 below lo)
        (1.2 * UP, 2.0, 1.2),
        (1.2 * UP, -2.0, None),
        (0.8 * DOWN, 2.0, None),
        (0.8 * DOWN, -2.0, 0.8),
        # far outside
        (3.0, 1.0, 1.2),
        (3.0, -1.0, None),
        (0.1, 1.0, None),
        (0.1, -1.0, 0.8),
    ],
)
def test_ppo_clip_boundaries(r, adv, clipped_to):
    if r in (0.8, 1.2):  # exactly on the boundary, bit for bit
        lp, q = t(exact_log(r)), t(0.0)
        assert torch.exp(lp - q).item() == r
    else:  # exp(lp - q) is then only r up to rounding: compare with the realised ratio
        q = t(-0.7)
        lp = q + math.log(r)
    ratio = torch.exp(lp - q).item()
    loss, grad = loss_and_grad(ppo, lp, q, t(adv))
    if clipped_to is None:  # loss = -r*A, gradient -r*A
        torch.testing.assert_close(loss, t(-ratio * adv), rtol=1e-12, atol=0)
        torch.testing.assert_close(grad, t(-ratio * adv), rtol=1e-12, atol=0)
    else:  # loss = -bound*A, constant in lp
        torch.testing.assert_close(loss, t(-clipped_to * adv), rtol=1e-12, atol=0)
        assert grad.item() == 0.0


def test_ppo_custom_thresholds():
    # r = 1.15 is inside the default [0.8, 1.2] but above hi = 1.1: A = 1 gives loss -1.1 and no gradient
    lp, q = t(math.log(1.15)), t(0.0)
    loss, grad = loss_and_grad(ppo, lp, q, t(1.0), clip_low_threshold=0.9, clip_high_threshold=1.1)
    torch.testing.assert_close(loss, t(-1.1))
    assert grad.item() == 0.0
    loss, grad = loss_and_grad(ppo, lp, q, t(1.0))
    torch.testing.assert_close(grad, t(-1.15))


def test_ppo_equals_importance_sampling_on_policy_and_inside_the_range():
    g = torch.Generator().manual_seed(0)
    q = -torch.rand(2, 5, generator=g, dtype=F64) * 3
    adv = torch.randn(2, 5, generator=g, dtype=F64)
    for lp in (q.clone(), q + 0.1 * (torch.rand(2, 5, generator=g, dtype=F64) - 0.5)):  # r = 1; r in [0.95, 1.05]
        loss_ppo, grad_ppo = loss_and_grad(ppo, lp, q, adv)
        loss_is, grad_is = loss_and_grad(importance_sampling, lp, q, adv)
        torch.testing.assert_close(loss_ppo, loss_is, rtol=0, atol=0)
        torch.testing.assert_close(grad_ppo, grad_is, rtol=0, atol=0)
    torch.testing.assert_close(loss_and_grad(ppo, q, q, adv)[1], -adv)  # on-policy: the REINFORCE gradient -A


# ---------------------------------------------------------------- cispo


def test_cispo_hand_computed():
    # r = [0.5, 1, 3, 5], default clip [0, 4]: weight w = [0.5, 1, 3, 4]; A = [1, -1, 2, 1]
    # loss = -w * lp * A; gradient = -w * A = [-0.5, 1, -6, -4]
    q = t(-1.0, -2.0, -3.0, -4.0)
    lp = q + t(math.log(0.5), 0.0, math.log(3.0), math.log(5.0))
    adv = t(1.0, -1.0, 2.0, 1.0)
    w = t(0.5, 1.0, 3.0, 4.0)
    loss, grad = loss_and_grad(cispo, lp, q, adv)
    torch.testing.assert_close(loss, -w * lp * adv)
    torch.testing.assert_close(grad, t(-0.5, 1.0, -6.0, -4.0))
    # with ppo's range the weights are [0.8, 1, 1.2, 1.2], and the out-of-range tokens keep their gradient
    loss, grad = loss_and_grad(cispo, lp, q, adv, clip_low_threshold=0.8, clip_high_threshold=1.2)
    torch.testing.assert_close(grad, t(-0.8, 1.0, -2.4, -1.2))
    assert loss_and_grad(ppo, lp, q, adv)[1][2:].tolist() == [0.0, 0.0]  # where ppo silences them


def test_cispo_gradient_is_the_clipped_weight_times_the_score():
    # pi = softmax(theta) over 4 tokens, token 2 sampled: grad_theta loss = -clamp(r) * A * (onehot - pi)
    theta = torch.tensor([0.2, -0.5, 1.0, 0.3], dtype=F64, requires_grad=True)
    q, adv = t(math.log(0.1)), t(1.5)  # pi(2) ~ 0.44, so r ~ 4.4 is clipped to 4
    lp = torch.log_softmax(theta, 0)[2:3]
    cispo(lp, q, adv).sum().backward()
    pi = torch.softmax(theta.detach(), 0)
    assert torch.exp(lp.detach() - q).item() > 4.0
    torch.testing.assert_close(theta.grad, -4.0 * 1.5 * (torch.eye(4, dtype=F64)[2] - pi))


# ---------------------------------------------------------------- dro


def test_dro_hand_computed():
    # beta = 0.5: loss = -(lp*A - 0.25*(lp - q)**2); gradient = -A + 0.5*(lp - q)
    # token 0: lp*A = -2, (lp - q)**2 = 0.25 -> 2.0625; gradient -2 + 0.25 = -1.75
    # token 1: lp*A = 2, (lp - q)**2 = 1 -> -1.75; gradient 1 - 0.5 = 0.5
    lp, q, adv = t(-1.0, -2.0), t(-1.5, -1.0), t(2.0, -1.0)
    loss, grad = loss_and_grad(dro, lp, q, adv, beta=0.5)
    torch.testing.assert_close(loss, t(2.0625, -1.75))
    torch.testing.assert_close(grad, t(-1.75, 0.5))
    loss, grad = loss_and_grad(dro, lp, q, adv, beta=0.0)  # no penalty: plain -lp*A
    torch.testing.assert_close(loss, t(2.0, -2.0))
    torch.testing.assert_close(grad, -adv)


# ---------------------------------------------------------------- registry, clip fraction, loss errors


def test_registry():
    assert LOSS_FNS == {"importance_sampling": importance_sampling, "ppo": ppo, "cispo": cispo, "dro": dro}
    assert get_loss_fn("cispo") is cispo
    with pytest.raises(ValueError, match="unknown loss 'grpo'; known losses: importance_sampling, ppo, cispo, dro"):
        get_loss_fn("grpo")


def test_loss_errors():
    x = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"logprobs and advantages must have the same shape, got \(2, 3\) and \(3,\)"):
        ppo(x, x, torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match=r"clip_low_threshold <= clip_high_threshold, got \[1.2, 0.8\]"):
        ppo(x, x, x, clip_low_threshold=1.2, clip_high_threshold=0.8)
    with pytest.raises(ValueError, match="dro needs beta >= 0, got -0.1"):
        dro(x, x, x, beta=-0.1)
    with pytest.raises(TypeError, match="logprobs must be a floating-point tensor"):
        importance_sampling(torch.zeros(3, dtype=torch.long), x[0], x[0])


def test_clip_fraction():
    # ratios [0.5, 0.8, 1, 1.2, 1.5, 2.0], the last masked out: 0.5 and 1.5 are outside -> 2 / 5
    lp = t(math.log(0.5), exact_log(0.8), 0.0, exact_log(1.2), math.log(1.5), math.log(2.0)).reshape(2, 3)
    q = torch.zeros(2, 3, dtype=F64)
    mask = t(1, 1, 1, 1, 1, 0).reshape(2, 3)
    frac = clip_fraction(lp, q, mask, 0.8, 1.2)
    assert frac.dim() == 0 and frac.dtype == F64
    assert frac.item() == pytest.approx(0.4)
    assert clip_fraction(lp, q, mask.bool(), 0.9, 1.1).item() == pytest.approx(0.8)  # now 0.8 and 1.2 count too
    assert clip_fraction(lp, q, torch.zeros_like(mask)).item() == 0.0  # empty mask: 0, not NaN


# ---------------------------------------------------------------- aggregate

LOSS_B_T = torch.arange(1.0, 13.0, dtype=F64).reshape(3, 4)  # [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
MASK_B_T = t(1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0).reshape(3, 4)  # ragged, and row 2 is empty


@pytest.mark.parametrize(
    "mode, expected, grad_rows",
    [
        # masked tokens: 1, 2 | 5, 6, 7, 8 | none; their sum is 29, their count 6
        ("sum", 29.0, (1.0, 1.0)),
        # row means 1.5 and 6.5; row 2 has no token and does not count: (1.5 + 6.5) / 2
        ("seq_mean_token_mean", 4.0, (1 / (2 * 2), 1 / (4 * 2))),
        ("token_mean", 29 / 6, (1 / 6, 1 / 6)),
        ("seq_mean_token_sum_norm", 29 / 30, (1 / 30, 1 / 30)),  # divided by B * max_tokens = 3 * 10
    ],
)
def test_aggregate_hand_computed(mode, expected, grad_rows):
    loss = LOSS_B_T.clone().requires_grad_(True)
    out = aggregate(loss, MASK_B_T, mode, max_tokens=10)  # max_tokens matters only to Dr. GRPO's mode
    assert out.dim() == 0
    assert out.item() == pytest.approx(expected)
    out.backward()
    expected_grad = torch.zeros(3, 4, dtype=F64)
    expected_grad[0, :2], expected_grad[1] = grad_rows
    torch.testing.assert_close(loss.grad, expected_grad)
    assert aggregate(LOSS_B_T, MASK_B_T.bool(), mode, max_tokens=10).item() == pytest.approx(expected)  # bool mask


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_empty_mask_and_padding(mode):
    loss = LOSS_B_T.clone().requires_grad_(True)
    out = aggregate(loss, torch.zeros(3, 4, dtype=F64), mode, max_tokens=4)
    assert out.item() == 0.0
    out.backward()  # still a graph to backpropagate through
    assert torch.equal(loss.grad, torch.zeros(3, 4, dtype=F64))
    padded = LOSS_B_T.clone()
    padded[2] = float("nan")  # e.g. log(0) at padding: outside the mask it must not matter
    assert (
        aggregate(padded, MASK_B_T, mode, max_tokens=4).item()
        == aggregate(LOSS_B_T, MASK_B_T, mode, max_tokens=4).item()
    )


def test_dr_grpo_divides_by_sequences_times_a_fixed_budget():
    # the contract: (values * mask).sum() / (B * M), whatever the padded length T of the batch
    values, mask = torch.randn(5, 7, dtype=F64), (torch.rand(5, 7) < 0.6).to(F64)
    got = aggregate(values, mask, "seq_mean_token_sum_norm", max_tokens=16)
    assert got.item() == pytest.approx(((values * mask).sum() / (5 * 16)).item())
    # padding the same datums to a longer T (e.g. a long prompt elsewhere in the call) changes nothing
    wide_values = torch.cat([values, torch.randn(5, 50, dtype=F64)], dim=1)
    wide_mask = torch.cat([mask, torch.zeros(5, 50, dtype=F64)], dim=1)
    assert aggregate(wide_values, wide_mask, "seq_mean_token_sum_norm", max_tokens=16).item() == pytest.approx(
        got.item()
    )
    with pytest.raises(ValueError, match="needs max_tokens"):
        aggregate(values, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="needs max_tokens"):
        aggregate(values, mask, "seq_mean_token_sum_norm", max_tokens=0)


def test_aggregate_errors():
    with pytest.raises(
        ValueError,
        match="unknown aggregation mode 'mean'; known modes: sum, seq_mean_token_mean, "
        "token_mean, seq_mean_token_sum_norm",
    ):
        aggregate(LOSS_B_T, MASK_B_T, "mean")
    with pytest.raises(ValueError, match=r"per_token_loss and mask must have the same shape, got \(3, 4\) and \(3,"):
        aggregate(LOSS_B_T, MASK_B_T[:, :3], "sum")
    with pytest.raises(ValueError, match=r"per_token_loss must be 2-D, got shape \(12,\)"):
        aggregate(LOSS_B_T.flatten(), MASK_B_T.flatten(), "sum")


# ---------------------------------------------------------------- KL penalty in the reward (Tinker's way)


def test_kl_penalty_advantages_worked_example():
    # the docstring's example, with a prompt position (mask 0) in front that must not move
    adv, q, mask = t(0.0, 1.0, 1.0, -1.0, -1.0), t(0.0, -0.5, -1.0, -2.0, -0.2), t(0, 1, 1, 1, 1)
    ref = q - t(9.0, 0.2, 0.0, -0.1, 0.3)  # k = q - ref = [., 0.2, 0.0, -0.1, 0.3]; mean over actions 0.1
    new, mean_k = kl_penalty_advantages(adv, q, ref, mask, kl_coef=1.0)
    assert mean_k.item() == pytest.approx(0.1)
    torch.testing.assert_close(new, t(0.0, 0.9, 1.1, -0.8, -1.2))
    same, _ = kl_penalty_advantages(adv, q, ref, mask, kl_coef=0.0)
    assert torch.equal(same, adv)
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        kl_penalty_advantages(adv, q, ref, mask, kl_coef=-1.0)


def test_kl_in_the_reward_follows_the_reverse_kl_gradient():
    # exact expectation over a categorical pi: E_pi[A'(x) * grad log pi(x)] with A' = -c * (k(x) - E k) equals
    # -c * grad KL(pi || ref): the penalty in the reward pulls pi toward ref along the reverse KL
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    pi, ref = logp.exp().detach(), REF
    adv, _ = kl_penalty_advantages(torch.zeros(5, dtype=F64), logp.detach(), ref.log(), torch.ones(5, dtype=F64), 1.0)
    # kl_penalty_advantages centres by the plain mean over tokens; with pi-weights the centring is E_pi[k]
    k = logp.detach() - ref.log()
    adv_pi = -(k - (pi * k).sum())
    (score_grad,) = torch.autograd.grad((pi * adv_pi * logp).sum(), theta)
    logp2 = torch.log_softmax(theta, -1)
    reverse_kl = (logp2.exp() * (logp2 - ref.log())).sum()
    (kl_grad,) = torch.autograd.grad(reverse_kl, theta)
    torch.testing.assert_close(score_grad, -kl_grad)
    assert torch.allclose(adv - adv.mean(), adv_pi - adv_pi.mean())  # the same per-token penalty up to a constant


def test_each_loss_keeps_its_own_clip_defaults():
    assert loss_fn_defaults("ppo") == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert loss_fn_defaults("cispo") == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert loss_fn_defaults("importance_sampling") == {}


# ---------------------------------------------------------------- kl estimators on an exact distribution

THETA = t(0.3, -1.2, 0.8, 0.0, -0.4)  # pi = softmax(THETA) over 5 tokens
REF = t(0.1, 0.3, 0.2, 0.25, 0.15)


def test_kl_per_token_hand_computed():
    # d = ref - lp = [log 2, 0, -log 2]
    lp, ref = t(math.log(0.25), -1.0, math.log(0.5)), t(math.log(0.5), -1.0, math.log(0.25))
    ln2 = math.log(2)
    torch.testing.assert_close(kl(lp, ref, "k1"), t(-ln2, 0.0, ln2))
    torch.testing.assert_close(kl(lp, ref, "k2"), t(ln2**2 / 2, 0.0, ln2**2 / 2))
    torch.testing.assert_close(kl(lp, ref, "k3"), t(2 - 1 - ln2, 0.0, 0.5 - 1 + ln2))
    assert kl(lp, ref, "k1").min() < 0 <= kl(lp, ref, "k3").min()


def test_kl_expectations_under_pi():
    pi = torch.softmax(THETA, 0)
    exact = (pi * (pi.log() - REF.log())).sum()  # KL(pi || ref)
    expect = {k: (pi * kl(pi.log(), REF.log(), k)).sum() for k in ("k1", "k2", "k3")}
    torch.testing.assert_close(expect["k1"], exact, rtol=0, atol=1e-6)
    torch.testing.assert_close(expect["k3"], exact, rtol=0, atol=1e-6)
    assert abs(expect["k2"] - exact) > 1e-2  # k2 is biased here: about 0.25 vs 0.29


def _grad(f) -> torch.Tensor:
    theta = THETA.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(f(theta), theta)
    return grad


def _as_loss_term(estimator):
    """E_pi[k] with pi's weights held fixed: what autograd sees for beta * mean(k) over on-policy samples."""

    def f(theta):
        logpi = torch.log_softmax(theta, 0)
        return (logpi.exp().detach() * kl(logpi, REF.log(), estimator)).sum()

    return f


def test_kl_estimator_gradients_as_loss_terms():
    grad_reverse = _grad(lambda th: (torch.softmax(th, 0) * (torch.log_softmax(th, 0) - REF.log())).sum())
    grad_forward = _grad(lambda th: (REF * (REF.log() - torch.log_softmax(th, 0))).sum())
    assert grad_reverse.norm() > 0.1 and grad_forward.norm() > 0.1
    assert (grad_reverse - grad_forward).norm() > 0.1  # the two KLs pull differently here
    # k1: zero expected gradient, no pull toward ref
    torch.testing.assert_close(_grad(_as_loss_term("k1")), torch.zeros(5, dtype=F64), rtol=0, atol=1e-12)
    # k2: the gradient of the reverse KL(pi || ref)
    torch.testing.assert_close(_grad(_as_loss_term("k2")), grad_reverse, rtol=0, atol=1e-12)
    # k3: the gradient of the forward KL(ref || pi)
    torch.testing.assert_close(_grad(_as_loss_term("k3")), grad_forward, rtol=0, atol=1e-12)


def test_k1_in_the_reward_gives_the_reverse_kl_gradient():
    # score-function term E_pi[k1 * grad log pi], k1 held fixed: what subtracting beta * k1 from the reward gives
    def f(theta):
        logpi = torch.log_softmax(theta, 0)
        return (logpi.exp().detach() * kl(logpi, REF.log(), "k1").detach() * logpi).sum()

    grad_reverse = _grad(lambda th: (torch.softmax(th, 0) * (torch.log_softmax(th, 0) - REF.log())).sum())
    torch.testing.assert_close(_grad(f), grad_reverse, rtol=0, atol=1e-12)


def test_kl_errors():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; known estimators: k1, k2, k3"):
        kl(THETA, REF, "k4")
    with pytest.raises(ValueError, match="train_logprobs and ref_logprobs must have the same shape"):
        kl(THETA, REF[:3], "k3")


# ---------------------------------------------------------------- group advantages and zero-variance groups


def test_group_advantages_worked_example():
    # mean 0.625: [1 - .625, .5 - .625, 0 - .625, 1 - .625]
    adv = group_advantages(t(1.0, 0.5, 0.0, 1.0)[None])
    torch.testing.assert_close(adv, t(0.375, -0.125, -0.625, 0.375)[None], rtol=0, atol=1e-12)
    torch.testing.assert_close(group_advantages(torch.tensor([[1, 0]])), torch.tensor([[0.5, -0.5]]))  # int rewards


@pytest.mark.parametrize("scale", ["none", "group", "batch"])
def test_zero_variance_group_is_exactly_zero(scale):
    rewards = t(0.1, 0.1, 0.1, 1.0, 0.0, 0.0).reshape(2, 3)
    assert (rewards[0] - rewards[0].mean()).abs().max() > 0  # the plain mean does not round back to 0.1
    adv = group_advantages(rewards, scale)
    assert torch.equal(adv[0], torch.zeros(3, dtype=F64))
    assert adv[1, 0] > 0 > adv[1, 1]


def test_group_and_batch_scaling():
    rewards = t(1, 0, 0, 0, 2, 4, 6, 8).reshape(2, 4)
    # group 0: mean .25, centered [.75, -.25, -.25, -.25], unbiased std sqrt(.75 / 3) = .5
    # group 1: mean 5, centered [-3, -1, 1, 3], unbiased std sqrt(20 / 3)
    centered = t(0.75, -0.25, -0.25, -0.25, -3, -1, 1, 3).reshape(2, 4)
    group_std = t(0.5, math.sqrt(20 / 3))[:, None]
    torch.testing.assert_close(group_advantages(rewards, "group"), centered / (group_std + 1e-6))
    torch.testing.assert_close(group_advantages(rewards, "group")[0], t(1.5, -0.5, -0.5, -0.5), rtol=1e-5, atol=0)
    batch_std = statistics.stdev([1, 0, 0, 0, 2, 4, 6, 8])  # sample std of all 8 rewards
    torch.testing.assert_close(group_advantages(rewards, "batch"), centered / (batch_std + 1e-6))


def test_group_advantages_errors():
    with pytest.raises(ValueError, match=r"rewards must be 2-D \(P, G\).*got shape \(4,\).*unsqueeze\(0\)"):
        group_advantages(t(1.0, 0.5, 0.0, 1.0))
    with pytest.raises(ValueError, match="unknown advantage scale 'std'; known scales: 'none', 'group', 'batch'"):
        group_advantages(t(1.0, 0.0)[None], "std")
    with pytest.raises(ValueError, match="need G >= 2 samples per prompt"):
        group_advantages(t(1.0, 0.0)[:, None])


def test_drop_zero_variance_groups():
    rewards = t(1, 1, 1, 0, 0, 0, 0.5, 1).reshape(4, 2)  # groups 0 and 2 are all-equal
    tokens = torch.arange(24).reshape(4, 2, 3)  # (P, G, T)
    names = ["a", "b", "c", "d"]
    assert zero_variance_groups(rewards).tolist() == [True, False, True, False]
    kept_rewards, kept_tokens, kept_names = drop_zero_variance_groups(rewards, tokens, names)
    torch.testing.assert_close(kept_rewards, rewards[[1, 3]])
    assert torch.equal(kept_tokens, tokens[[1, 3]])
    assert kept_names == ["b", "d"]
    (none_left,) = drop_zero_variance_groups(torch.zeros(2, 3))
    assert none_left.shape == (0, 3)
    with pytest.raises(ValueError, match="others\\[0\\] has 3 entries but rewards has 4 groups"):
        drop_zero_variance_groups(rewards, names[:3])


def test_rl_objective_by_hand():
    # one sequence, three action tokens and a padded position; importance sampling, token_mean
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.5, 0.9]])).requires_grad_(True)
    q = torch.log(torch.tensor([[0.5, 0.5, 0.25, 0.1]]))
    adv = torch.tensor([[1.0, 2.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    ref = torch.log(torch.tensor([[0.25, 0.25, 0.5, 0.3]]))
    loss, m = L.rl_objective(
        lp,
        q,
        adv,
        mask,
        loss_fn="importance_sampling",
        aggregation="token_mean",
        ref_logprobs=ref,
        kl_coef=0.5,
        kl_estimator="k1",
    )
    # ratios 1, 0.5, 2: per-token -r*A = -1, -1, 2 -> mean 0; k1 = lp - ref = log 2, 0, 0 -> mean log(2)/3
    assert loss.item() == pytest.approx(0.5 * math.log(2) / 3)
    # q - lp on action tokens: 0, log 2, -log 2
    assert m["optim/kl_sample_train_v1"] == pytest.approx(0.0, abs=1e-7)
    assert m["optim/kl_sample_train_v2"] == pytest.approx(math.log(2) ** 2 / 3)
    assert m["optim/clip_fraction"] == pytest.approx(2 / 3)  # 0.5 and 2 lie outside [0.8, 1.2]
    # k3 with d = ref - lp = -log 2, 0, 0: exp(d) - 1 - d = log 2 - 1/2
    assert m["optim/kl_ref"] == pytest.approx((math.log(2) - 0.5) / 3)
    assert "optim/entropy" not in m
    loss.backward()
    assert lp.grad[0, 3] == 0  # padding gets no gradient


def test_rl_objective_takes_a_function_and_checks_its_inputs():
    lp, q, adv, mask = torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3)
    loss, m = L.rl_objective(
        lp,
        q,
        adv,
        mask,
        loss_fn=lambda a, b, c: -c * torch.exp(a - b),
        aggregation="sum",
        entropy=torch.full((2, 3), 0.25),
    )
    assert loss.item() == -6.0 and m["optim/entropy"] == 0.25 and m["optim/clip_fraction"] == 0.0
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        L.rl_objective(lp, q, adv, mask, loss_fn="ppo", kl_coef=0.1)
    with pytest.raises(ValueError, match="same shape"):
        L.rl_objective(lp, q[:, :2], adv, mask, loss_fn="ppo")
    with pytest.raises(ValueError, match="unknown loss"):
        L.rl_objective(lp, q, adv, mask, loss_fn="grpo")


def test_clip_bounds_are_the_losss_own():
    assert L.clip_bounds("ppo") == (0.8, 1.2)
    assert L.clip_bounds("cispo", {"clip_high_threshold": 5.0}) == (0.0, 5.0)
    assert L.clip_bounds("dro", {"beta": 0.1}) == (0.8, 1.2)


@pytest.mark.parametrize("name", sorted(L.LOSS_FNS))
def test_which_losses_have_no_gradient_at_zero_advantage(name):
    """ZERO_AT_ZERO_ADVANTAGE lets forward_backward skip the backward pass of datums whose advantages are all 0;
    that is exact only for losses whose value and gradient vanish there at any ratio."""
    g = torch.Generator().manual_seed(0)
    train = (torch.randn(3, 5, generator=g) - 1).requires_grad_()
    sampling = torch.randn(3, 5, generator=g) - 1  # ratios far from 1, some outside every clip range
    config = {"beta": 0.1} if name == "dro" else {}
    per_token = L.LOSS_FNS[name](train, sampling, torch.zeros(3, 5), **config)
    per_token.sum().backward()
    vanishes = bool((per_token == 0).all() and (train.grad == 0).all())
    assert vanishes == (name in L.ZERO_AT_ZERO_ADVANTAGE)


@pytest.mark.parametrize("name", sorted(L.ZERO_AT_ZERO_ADVANTAGE))
def test_a_ratio_that_overflows_at_zero_advantage_adds_nothing(name):
    # a sampler log-prob 100 nats below the trainer's: exp(100) is inf in float32, and inf * 0 gave NaN in the
    # value and the gradient, so scoring a zero-advantage datum and skipping it gave different updates
    train = torch.tensor([[-0.5, -0.2]], requires_grad=True)
    sampling = torch.tensor([[-100.5, -0.3]])
    per_token = L.LOSS_FNS[name](train, sampling, torch.tensor([[0.0, 1.0]]))
    per_token.sum().backward()
    assert per_token[0, 0] == 0 and train.grad[0, 0] == 0
    assert torch.isfinite(per_token).all() and torch.isfinite(train.grad).all()


def test_the_metrics_count_a_fractional_mask_as_the_loss_does():
    # aggregate counts every nonzero mask entry whole; the metrics weighted a 0.5 by half
    lp, q = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    adv = torch.ones(1, 2)
    half = L.rl_objective(lp, q, adv, torch.tensor([[0.5, 1.0]]), loss_fn="importance_sampling")
    whole = L.rl_objective(lp, q, adv, torch.tensor([[1.0, 1.0]]), loss_fn="importance_sampling")
    assert half[0] == whole[0] and half[1] == whole[1]
