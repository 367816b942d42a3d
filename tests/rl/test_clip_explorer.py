import matplotlib.pyplot as plt
import torch

from edurl.rl.clip_explorer import clip_case, clip_objective_and_grad, plot_clip_explorer


def test_objective_and_gradient_hand_values():
    r = torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64)
    obj, grad = clip_objective_and_grad(r, 1.0, 0.2)
    torch.testing.assert_close(obj, torch.tensor([0.5, 1.0, 1.2], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))
    obj, grad = clip_objective_and_grad(r, -1.0, 0.2)
    torch.testing.assert_close(obj, torch.tensor([-0.8, -1.0, -1.5], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([0.0, -1.0, -1.0], dtype=torch.float64))


def test_clip_case():
    assert clip_case(1.5, 1.0, 0.2) == ("clipped", True)
    assert clip_case(1.0, -1.0, 0.2) == ("both", False)


def test_plot_has_two_panels():
    axes = plot_clip_explorer(0.3)
    assert len(axes) == 2 and "0.30" in axes[0].get_title()
    plt.close("all")


def test_ratios_of_0_are_refused_and_the_cases_use_a_tight_tolerance():
    """r = 0 (log 0) gave a NaN gradient, and clip_case(0, ...) said the gradient was not 0; np.isclose's 1e-5
    called r = 1.200001 'both' at eps = 0.2, where the clipped term is smaller."""
    import numpy as np
    import pytest

    with pytest.raises(ValueError, match="> 0"):
        clip_objective_and_grad(torch.tensor([0.0, 0.5]), -1.0, 0.2)
    with pytest.raises(ValueError, match="> 0"):
        clip_case(0.0, -1.0, 0.2)
    assert clip_case(1.200001, 1.0, 0.2) == ("clipped", True)
    assert clip_case(1.2000000001, 1.0, 0.2) == clip_case(0.7999999999, -1.0, 0.2) == ("clipped", True)
    obj, grad = clip_objective_and_grad(np.array([0.5, 1.5]), 1.0, 0.2)  # an array, as a list, works too
    torch.testing.assert_close(grad, torch.tensor([1.0, 0.0], dtype=torch.float64))
