import math

import pytest
import torch

from edurl import objectives, rl
from edurl.llm import losses
from edurl.objectives import clip_fraction, clipped_surrogate, entropy


def _loss_and_grad(ratio, adv, low=0.8, high=1.2):
    logp = torch.tensor([math.log(ratio)], dtype=torch.float64, requires_grad=True)
    loss = clipped_surrogate(
        logp, torch.zeros(1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64), low, high
    )
    loss.sum().backward()
    return loss.item(), logp.grad.item()


@pytest.mark.parametrize(
    "ratio, adv, loss, grad",
    [
        (1.0, 2.0, -2.0, -2.0),  # inside [0.8, 1.2]: loss = -r*A, d loss / d logp = -r*A
        (1.5, 2.0, -2.4, 0.0),  # A > 0 above the range: the clipped term binds, no gradient
        (0.5, 2.0, -1.0, -1.0),  # A > 0 below the range: the unclipped term is the min, gradient flows
        (0.5, -1.0, 0.8, 0.0),  # A < 0 below the range: clipped, no gradient
        (1.5, -1.0, 1.5, 1.5),  # A < 0 above the range: "undo" moves keep their gradient
        (1.2, 2.0, -2.4, -2.4),  # on the boundary the gradient still flows
    ],
)
def test_clipped_surrogate_hand_values_and_gradients(ratio, adv, loss, grad):
    got_loss, got_grad = _loss_and_grad(ratio, adv)
    assert got_loss == pytest.approx(loss) and got_grad == pytest.approx(grad)


def test_an_asymmetric_range():
    assert _loss_and_grad(1.25, 1.0, 0.8, 1.28) == pytest.approx((-1.25, -1.25))  # DAPO's clip-higher keeps it
    assert _loss_and_grad(1.25, 1.0, 0.8, 1.2) == pytest.approx((-1.2, 0.0))


def test_clip_fraction_by_hand_with_and_without_a_mask():
    lp = torch.log(torch.tensor([0.7, 1.0, 1.25, 1.2]))
    q = torch.zeros(4)
    assert clip_fraction(lp, q, None, 0.8, 1.2).item() == pytest.approx(0.5)
    assert clip_fraction(lp, q, torch.tensor([1, 1, 0, 1]), 0.8, 1.2).item() == pytest.approx(1 / 3)
    assert clip_fraction(lp, q, torch.zeros(4), 0.8, 1.2).item() == 0.0


def test_entropy_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.5], [1.0, 1e-30]]))
    assert entropy(logp).tolist() == pytest.approx([math.log(2), 0.0], abs=1e-6)
    # an action of probability exactly 0 (a masked logit): 0 log 0 = 0, where the product was once nan
    logits = torch.tensor([0.0, 0.0, -math.inf], requires_grad=True)
    h = entropy(torch.log_softmax(logits, -1))
    h.backward()
    assert h.item() == pytest.approx(math.log(2)) and torch.isfinite(logits.grad).all()


def test_one_clip_for_the_whole_course():
    # Chapter 5's PPO and Chapter 7's LLM losses use these very functions, not copies of them
    assert rl.clipped_surrogate is objectives.clipped_surrogate
    assert losses.clip_fraction is objectives.clip_fraction
    assert rl.ppo.clipped_surrogate is objectives.clipped_surrogate and rl.ppo.clip_fraction is objectives.clip_fraction
    assert losses.ppo.__globals__["clipped_surrogate"] is objectives.clipped_surrogate


def test_a_reversed_range_is_refused():
    with pytest.raises(ValueError, match="clip_low_threshold <= clip_high_threshold"):
        clipped_surrogate(torch.zeros(1), torch.zeros(1), torch.ones(1), 1.2, 0.8)


def test_the_closed_form_gradient_checks_its_inputs_as_the_loss_does():
    """clipped_surrogate_grad broadcast (3,) against (3, 1) into a (3, 3) gradient, and with the clip range the
    wrong way round it gave zeros; clip_fraction gave 1.0 there. clipped_surrogate refuses both."""
    lp, adv = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match="same shape"):
        objectives.clipped_surrogate_grad(lp, torch.zeros(3, 1), adv, 0.8, 1.2)
    with pytest.raises(ValueError, match="same shape"):
        objectives.clipped_surrogate_grad(lp, lp, torch.ones(1, 3), 0.8, 1.2)
    with pytest.raises(ValueError, match="clip_low_threshold <= clip_high_threshold"):
        objectives.clipped_surrogate_grad(lp, lp, adv, 1.2, 0.8)
    with pytest.raises(ValueError, match="clip_low_threshold <= clip_high_threshold"):
        clip_fraction(lp, lp, clip_low_threshold=1.2, clip_high_threshold=0.8)
    assert objectives.clipped_surrogate_grad(lp, lp, adv, 0.8, 1.2).tolist() == [-1.0, -1.0, -1.0]


def test_a_clip_range_without_1_is_refused():
    # r = 1 on-policy: a range that leaves it out clips every sample before the policy moves
    lp = torch.zeros(3)
    with pytest.raises(ValueError, match="leaves out r = 1"):
        clipped_surrogate(lp, lp, torch.ones(3), 1.1, 1.3)
    assert clipped_surrogate(lp, lp, torch.ones(3), 1.0, 1.0).tolist() == [-1.0] * 3  # eps = 0 keeps r = 1


def test_check_clip_range_names_a_nan_bound():
    for low, high in ((float("nan"), 1.2), (0.8, float("nan"))):  # was "needs low <= high", which NaN is not
        with pytest.raises(ValueError, match="a NaN bound"):
            objectives.check_clip_range(low, high)
    objectives.check_clip_range(0.8, float("inf"))  # no upper clip stays allowed
