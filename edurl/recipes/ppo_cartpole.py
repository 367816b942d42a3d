"""PPO on CartPole-v1 (Chapter 5). ``python -m edurl.recipes.ppo_cartpole --env-backend torch --seed 2``

Writes ``<log_dir>/metrics.jsonl`` (with every PPO diagnostic per update) and ``<log_dir>/learning_curve.png``
(log_dir: runs/ppo_cartpole).
"""

from edurl.recipes._cli import run_as_script, run_trainer_recipe
from edurl.rl.ppo import PPOConfig, train_ppo


def main(argv=None):
    return run_trainer_recipe(PPOConfig, train_ppo, "PPO", argv)


if __name__ == "__main__":
    run_as_script(main)
