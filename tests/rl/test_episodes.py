import pytest

from edurl.rl import solved_at
from edurl.rl.episodes import EpisodeLog, TrainerConfig


def test_solved_at_hand_computed():
    assert solved_at([1, 2, 3], threshold=2, window=2) == 2  # means: 1.5, 2.5 -> episode index 2
    assert solved_at([5, 5], threshold=5, window=3) is None  # not a full window yet
    assert solved_at([0, 10, 0, 10], threshold=6, window=2) is None
    assert solved_at([475] * 100, window=100) == 99
    with pytest.raises(ValueError):
        solved_at([1], window=0)


def test_episode_log_rows_and_stop_rule():
    log = EpisodeLog(TrainerConfig(solve_threshold=10, solve_window=2))
    log.add([5.0, 20.0], [5, 20], step=25)
    assert len(log) == 2 and log.rows[1] == {
        "episode": 1,
        "step": 25,
        "episode_return": 20.0,
        "episode_length": 20,
        "time/total": log.rows[1]["time/total"],
    }
    assert log.recent_mean() == 12.5 and log.should_stop()
    result = log.result(policy=None, value=None)
    assert result.solved_episode == 2 and result.solved_step == 25
    never = EpisodeLog(TrainerConfig(solve_threshold=10, solve_window=2, stop_when_solved=False))
    never.add([50.0, 50.0], [50, 50], step=100)
    assert not never.should_stop() and never.result(None, None).solved


def test_a_nan_or_inf_return_reaches_only_the_windows_that_hold_it():
    """A running sum carried one NaN into every later window, so a run that then solved was never solved."""
    assert solved_at([float("nan"), 500, 500], 475, 2) == 2
    assert solved_at([float("nan"), 500, 500], 475, 3) is None
    assert solved_at([0.0, float("inf"), 0.0, 0.0, 0.0], 475, 2) == 1  # a window holding +inf has an infinite mean
    assert solved_at([float("-inf"), 0, 480, 480], 475, 2) == 3
    assert solved_at([470, 480, 490], 475, 2) == 1  # finite returns as before


@pytest.mark.parametrize("window", [0, 2.0, True])
def test_a_window_that_is_not_a_count_is_named(window):
    with pytest.raises(ValueError, match="window must be a whole number"):
        solved_at([500, 500], 475, window)
