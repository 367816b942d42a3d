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
