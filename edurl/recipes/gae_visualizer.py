"""The GAE visualiser of Chapter 4 as a PNG: TD errors and GAE(lambda) advantages along one CartPole episode.

``python -m edurl.recipes.gae_visualizer --gamma 0.99 --out gae.png``

The policy and critic come from a short REINFORCE run with a value baseline (a few seconds), so the
critic is a real, imperfect one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from edurl._checks import check_fields, check_gamma
from edurl.recipes._cli import parse_config, run_as_script, save_figure
from edurl.utils import file_in_the_way


@dataclass
class GAEVisualizerConfig:
    gamma: float = 0.99
    """Discount factor."""
    lams: tuple[float, ...] = (0.0, 0.5, 0.9, 0.95, 1.0)
    """The lambdas to draw (on the command line: --lams 0 0.5 1)."""
    train_episodes: int = 64
    """REINFORCE (value baseline) episodes to train the policy and critic before drawing."""
    seed: int = 0
    """Seed for training and for the episode drawn."""
    out: str = "gae_visualizer.png"
    """Where to write the figure (".png" is added to a name without an image extension; missing folders are made)."""

    def __post_init__(self) -> None:
        self.out = os.fspath(self.out)  # a Path too
        check_gamma(self.gamma)
        check_fields(self, positive_int=("train_episodes",), nonneg_int=("seed",))
        if not self.lams or not all(isinstance(lam, (int, float)) and 0 <= lam <= 1 for lam in self.lams):
            raise ValueError(f"GAEVisualizerConfig.lams must be one or more numbers in [0, 1], got {self.lams!r}.")
        if Path(self.out).is_dir() or self.out.endswith(("/", os.sep)):  # "figs/" was written to figs/.png
            folder = self.out.rstrip("/" + os.sep)
            raise ValueError(f"GAEVisualizerConfig.out {self.out!r} is a folder; name the PNG, e.g. {folder}/gae.png")
        clash = file_in_the_way(Path(self.out).parent)  # else save_figure refused it only after the training
        if clash is not None:
            raise ValueError(f"GAEVisualizerConfig.out {self.out!r}: {clash}; name a PNG in a folder (made if missing)")
        from matplotlib.backend_bases import FigureCanvasBase

        # a name without an image extension gets ".png": "gae_gamma0.99" has the suffix ".99", which savefig refused
        # only after the training; matplotlib would add ".png" to a bare name itself, and the path printed be wrong
        if Path(self.out).suffix.lower().lstrip(".") not in FigureCanvasBase.get_supported_filetypes():
            self.out = f"{self.out}.png"


def main(argv=None):
    from edurl.rl.gae_study import plot_gae, sample_trajectory
    from edurl.rl.reinforce import ReinforceConfig, train_reinforce

    config = parse_config(GAEVisualizerConfig, argv)
    trained = train_reinforce(
        ReinforceConfig(
            seed=config.seed, max_episodes=config.train_episodes, baseline="value", stop_when_solved=False, device="cpu"
        )
    )
    traj = sample_trajectory(trained.policy, trained.value, seed=config.seed)
    save_figure(plot_gae(traj, config.gamma, config.lams).figure, config.out, dpi=120, bbox_inches="tight")
    print(f"episode of {len(traj['rewards'])} steps; wrote {config.out}")
    return config.out


if __name__ == "__main__":
    run_as_script(main)
