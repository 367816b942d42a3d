"""Small MLP policy and value networks for vector observations (CartPole). Chapters 2–5.

Orthogonal initialisation with a small gain on the policy's last layer makes the first policy close
to uniform, and a gain of 1 on the value head keeps early value targets on a sane scale (a detail
from the PPO implementations studied by Engstrom et al., 2020, and Huang et al., 2022).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributions import Categorical

from edurl.objectives import entropy

__all__ = ["mlp", "CategoricalPolicy", "ValueNet", "module_device", "module_dtype"]


def module_device(module: nn.Module) -> torch.device:
    """Where ``module`` keeps its first parameter (or buffer); the CPU for a module with neither."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def module_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of ``module``'s first floating-point parameter (or buffer), the one its inputs must have; torch's
    default dtype for a module with none, or for a plain function (a critic such as ``lambda obs: 0 * obs[..., 0]``)."""
    if not isinstance(module, nn.Module):
        return torch.get_default_dtype()
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.get_default_dtype()


def mlp(in_dim: int, out_dim: int, hidden_sizes: Sequence[int] = (64, 64), *, out_gain: float = 1.0) -> nn.Sequential:
    """in_dim -> hidden (tanh) -> ... -> out_dim, orthogonally initialised."""
    sizes = [in_dim, *hidden_sizes]
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    layers.append(nn.Linear(sizes[-1], out_dim))
    for i, layer in enumerate(m for m in layers if isinstance(m, nn.Linear)):
        last = i == len(hidden_sizes)
        nn.init.orthogonal_(layer.weight, gain=out_gain if last else math.sqrt(2))
        nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


class CategoricalPolicy(nn.Module):
    """pi(a | s) over a discrete action set: an MLP gives logits (B, A)."""

    def __init__(self, obs_dim: int, num_actions: int, hidden_sizes: Sequence[int] = (64, 64)):
        super().__init__()
        self.net = mlp(obs_dim, num_actions, hidden_sizes, out_gain=0.01)

    def forward(self, obs: torch.Tensor) -> Categorical:
        return Categorical(logits=self.net(obs))  # obs (B, obs_dim) -> distribution over (B,) actions

    def logprob_and_entropy(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log pi(a|s) (B,) and the entropy of pi(.|s) (B,), without building a Distribution (PPO's inner loop)."""
        logp = torch.log_softmax(self.net(obs), -1)  # (B, A)
        return logp.gather(-1, actions[:, None]).squeeze(-1), entropy(logp)

    @torch.no_grad()
    def sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample a ~ pi(.|s) for each row: returns actions (B,) and their log-probs (B,)."""
        logp = torch.log_softmax(self.net(obs), -1)
        actions = torch.multinomial(logp.exp(), 1)  # (B, 1)
        return actions.squeeze(-1), logp.gather(-1, actions).squeeze(-1)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """Sample an action per observation, or take the most likely one. Returns (B,) int64."""
        logits = self.net(obs)
        if greedy:
            return logits.argmax(-1)
        return torch.multinomial(torch.softmax(logits, -1), 1).squeeze(-1)


class ValueNet(nn.Module):
    """V(s): an MLP with one output, squeezed to (B,)."""

    def __init__(self, obs_dim: int, hidden_sizes: Sequence[int] = (64, 64)):
        super().__init__()
        self.net = mlp(obs_dim, 1, hidden_sizes, out_gain=1.0)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).squeeze(-1)
