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


def test_module_device_reads_the_first_parameter_and_falls_back_to_the_cpu():
    from edurl.rl.networks import module_device

    assert module_device(ValueNet(4).to("meta")) == torch.device("meta")
    assert module_device(torch.nn.Identity()) == torch.device("cpu")  # no parameters: a hand-written policy
