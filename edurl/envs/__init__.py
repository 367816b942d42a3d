"""Environments written for the course: ``TorchCartPole``, CartPole-v1 as a batched torch program."""

from edurl.envs.cartpole import TorchCartPole

__all__ = ["TorchCartPole"]
