"""REINFORCE on CartPole-v1 (Chapter 2). ``python -m edurl.recipes.reinforce_cartpole --seed 1 --learning-rate 0.005``

Writes ``<log_dir>/metrics.jsonl`` and ``<log_dir>/learning_curve.png`` (log_dir: runs/reinforce_cartpole).
"""

from edurl.recipes._cli import run_as_script, run_trainer_recipe
from edurl.rl.reinforce import ReinforceConfig, train_reinforce


def main(argv=None):
    return run_trainer_recipe(ReinforceConfig, train_reinforce, "REINFORCE", argv)


if __name__ == "__main__":
    run_as_script(main)
