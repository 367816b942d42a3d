"""REINFORCE on CartPole-v1 (Chapter 2). ``python -m edurl.recipes.reinforce_cartpole --seed 1 --lr 0.005``

Writes ``<log_dir>/metrics.jsonl`` and ``<log_dir>/learning_curve.png``.
"""

from pathlib import Path

from edurl.recipes._cli import parse_config, report, save_learning_curve
from edurl.rl.reinforce import ReinforceConfig, train_reinforce


def main(argv=None):
    config = parse_config(ReinforceConfig, argv, log_dir="runs/reinforce_cartpole")
    result = train_reinforce(config)
    png = save_learning_curve(result, Path(config.log_dir) / "learning_curve.png", "REINFORCE")
    report(result, png)
    return result


if __name__ == "__main__":
    main()
