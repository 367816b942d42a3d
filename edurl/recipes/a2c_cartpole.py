"""A2C with GAE on CartPole-v1 (Chapter 3). ``python -m edurl.recipes.a2c_cartpole --lam 0.9 --num-envs 16``

Writes ``<log_dir>/metrics.jsonl`` and ``<log_dir>/learning_curve.png``.
"""

from pathlib import Path

from edurl.recipes._cli import parse_config, report, save_learning_curve
from edurl.rl.a2c import A2CConfig, train_a2c


def main(argv=None):
    config = parse_config(A2CConfig, argv, log_dir="runs/a2c_cartpole")
    result = train_a2c(config)
    png = save_learning_curve(result, Path(config.log_dir) / "learning_curve.png", "A2C")
    report(result, png)
    return result


if __name__ == "__main__":
    main()
