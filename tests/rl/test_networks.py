import torch

from edurl.rl import CategoricalPolicy, ValueNet


def test_networks_shapes_and_near_uniform_start():
    torch.manual_seed(0)
    policy, value = CategoricalPolicy(4, 2), ValueNet(4)
    obs = torch.randn(5, 4)
    dist = policy(obs)
    assert dist.probs.shape == (5, 2) and value(obs).shape == (5,)
    assert (dist.probs - 0.5).abs().max() < 0.05  # small last-layer gain: close to uniform
    assert policy.act(obs).shape == (5,) and policy.act(obs, greedy=True).dtype == torch.int64
