"""A2C with GAE on CartPole-v1 (Chapter 3). ``python -m edurl.recipes.a2c_cartpole --lam 0.9 --num-envs 16``

Writes ``<log_dir>/metrics.jsonl`` and ``<log_dir>/learning_curve.png`` (log_dir: runs/a2c_cartpole).
"""

from edurl.recipes._cli import run_as_script, run_trainer_recipe
from edurl.rl.a2c import A2CConfig, train_a2c


def main(argv=None):
    return run_trainer_recipe(A2CConfig, train_a2c, "A2C", argv)


if __name__ == "__main__":
    run_as_script(main)
