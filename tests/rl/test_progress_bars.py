"""Every long loop in edurl.rl draws a throttled bar (edurl.utils.progress), not a plain tqdm bar.

A Jupyter kernel keeps at most 1000 unread output messages and drops the rest; nbval reads a cell's
messages only once the cell has run. A plain bar redraws on every update (and again on every
``set_postfix``), so a long training cell can pass that limit and nbval reports a timeout (it did,
for notebook 03's A2C/REINFORCE cell on a slow machine). Each test here runs ~300 updates of a loop
under a fake clock on which every step takes 2 s, so only the bar's own step-count throttle can hold
a redraw back, and counts the redraws: a throttled bar draws about 100 (plus its first and last);
a plain one draws at least one per update.
"""

import itertools
import time

import gymnasium as gym
import pytest
import torch
import tqdm.std

from edurl.rl import (
    A2CConfig,
    CategoricalPolicy,
    PPOConfig,
    ReinforceConfig,
    ValueNet,
    monte_carlo_value,
    train_a2c,
    train_ppo,
    train_reinforce,
    uniform_policy,
)
from edurl.rl.gae_study import gae_bias_variance
from edurl.rl.policy_gradient import gradient_variance
from edurl.rl.tabular import TabularMDP

UPDATES = 300  # loop iterations in every run below
MAX_REDRAWS = 110  # progress's ~100, its first and last draw, and some slack


@pytest.fixture
def redraws(monkeypatch, capsys):
    """Call it after a run: the number of times a bar was drawn to stderr since the test started."""
    clock = itertools.count(time.time(), 2.0)  # every reading is 2 s later: the 1 s time limit never binds
    monkeypatch.setattr(tqdm.std, "time", lambda: next(clock))  # tqdm reads its clock through this name
    monkeypatch.setattr(tqdm.std.tqdm, "monitor_interval", 0)  # no monitor thread on the real clock
    capsys.readouterr()
    return lambda: capsys.readouterr().err.count("\r")


def _tiny(**kw):
    return dict(hidden_sizes=(8,), seed=0, device="cpu", progress=True, stop_when_solved=False, **kw)


RUNS = {
    # trainers: bar.update(n) with total=...
    # a small lr keeps episodes short (and the test fast): the bar does not care what is learned
    "reinforce": lambda: train_reinforce(
        ReinforceConfig(**_tiny(episodes_per_update=2, max_episodes=2 * UPDATES, learning_rate=1e-4))
    ),
    "reinforce-torch": lambda: train_reinforce(
        ReinforceConfig(
            **_tiny(episodes_per_update=2, max_episodes=2 * UPDATES, learning_rate=1e-4, env_backend="torch")
        )
    ),
    "a2c": lambda: train_a2c(A2CConfig(**_tiny(num_envs=2, num_steps=2, total_steps=4 * UPDATES))),
    "ppo": lambda: train_ppo(
        PPOConfig(**_tiny(env_backend="torch", num_envs=2, num_steps=2, update_epochs=1, total_steps=4 * UPDATES))
    ),
}


def _gradient_variance():
    torch.manual_seed(0)
    gradient_variance(
        CategoricalPolicy(4, 2, (8,)),
        "CartPole-v1",
        {"none": lambda obs, G: 0.0},
        num_batches=UPDATES,
        episodes_per_batch=1,
    )


def _gae_study():
    torch.manual_seed(0)
    states = torch.zeros(UPDATES, 4)
    gae_bias_variance(
        CategoricalPolicy(4, 2, (8,)),
        ValueNet(4, (8,)),
        states,
        torch.zeros(UPDATES, dtype=torch.long),
        lams=[0.5],
        num_truth=2,
        num_samples=2,
        horizon=2,
    )


def _monte_carlo():
    mdp = TabularMDP.from_gymnasium(gym.make("FrozenLake-v1"))
    monte_carlo_value(gym.make("FrozenLake-v1", max_episode_steps=20), uniform_policy(mdp), 0.9, UPDATES)


# analysis loops: iterating the bar
RUNS.update({"gradient_variance": _gradient_variance, "gae_bias_variance": _gae_study, "monte_carlo": _monte_carlo})


@pytest.mark.parametrize("name", list(RUNS))
def test_long_loops_redraw_their_bar_about_100_times(name, redraws):
    RUNS[name]()
    n = redraws()
    # a plain tqdm bar draws once per update at least (REINFORCE/A2C/PPO: twice, with set_postfix): >= 300
    assert 50 <= n <= MAX_REDRAWS, f"{name}: the bar was drawn {n} times in {UPDATES} updates"


def test_a_plain_bar_would_redraw_on_every_update(redraws):
    # the counter itself: the pattern the trainers used before, with tqdm's own defaults
    bar = tqdm.std.tqdm(total=4 * UPDATES)
    for _ in range(UPDATES):
        bar.update(4)
        bar.set_postfix(mean_return="20")
    bar.close()
    assert redraws() >= 2 * UPDATES
