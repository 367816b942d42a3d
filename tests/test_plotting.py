import warnings

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from edurl.plotting import align_curves, plot_datum_layout, plot_learning_curves, plot_value_grid, rolling_mean


def test_rolling_mean_hand_computed():
    np.testing.assert_allclose(rolling_mean([1, 2, 3, 4], 2), [1, 1.5, 2.5, 3.5])
    np.testing.assert_allclose(rolling_mean([2, 4, 6], 10), [2, 3, 4])
    np.testing.assert_allclose(rolling_mean([5.0], 1), [5.0])
    with pytest.raises(ValueError, match="window"):
        rolling_mean([1, 2], 0)


def test_align_curves_interpolates_on_the_common_range():
    a = pd.DataFrame({"step": [0, 10, 20], "r": [0.0, 10.0, 20.0]})
    b = pd.DataFrame({"step": [5, 15, 30], "r": [0.0, 0.0, 0.0]})
    grid, Y = align_curves([a, b], "step", "r", num_points=3)
    np.testing.assert_allclose(grid, [5, 12.5, 20])  # the range both cover
    np.testing.assert_allclose(Y[0], [5, 12.5, 20])  # a is y = x
    np.testing.assert_allclose(Y[1], [0, 0, 0])


def test_align_curves_smooths_before_interpolating():
    a = pd.DataFrame({"step": [0, 1, 2, 3], "r": [0.0, 2.0, 0.0, 2.0]})
    grid, Y = align_curves([a], "step", "r", window=2, num_points=4)
    np.testing.assert_allclose(Y[0], [0, 1, 1, 1])


def test_align_curves_errors():
    with pytest.raises(KeyError, match="no column 'reward'"):
        align_curves([pd.DataFrame({"step": [0]})], "step", "reward")
    with pytest.raises(ValueError, match="no common"):
        align_curves([pd.DataFrame({"s": [0, 1], "r": [0, 0]}), pd.DataFrame({"s": [5, 6], "r": [0, 0]})], "s", "r")
    with pytest.raises(ValueError, match="one DataFrame per seed"):
        align_curves([], "s", "r")


def test_plot_learning_curves_draws_mean_and_band():
    seeds = [pd.DataFrame({"step": np.arange(10) * 10, "episode_return": np.full(10, v)}) for v in (1.0, 3.0)]
    ax = plot_learning_curves({"ppo": seeds}, window=1, x="step")
    line = ax.get_lines()[0]
    np.testing.assert_allclose(line.get_ydata(), 2.0)  # mean of 1 and 3
    assert "ppo (2 seeds)" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(ax.collections) == 1  # the min-max band
    plt.close("all")
    with pytest.raises(ValueError, match="band"):
        plot_learning_curves(seeds, band="iqr")


def test_plot_value_grid_draws_every_cell():
    import gymnasium as gym

    from edurl.rl import TabularMDP, value_iteration

    mdp = TabularMDP.from_gymnasium(gym.make("FrozenLake-v1"))
    V, policy, _ = value_iteration(mdp, 0.9)
    ax = plot_value_grid(V, mdp, policy=policy)
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("H") == 4 and texts.count("G") == 1 and f"{V[0].item():.2f}" in texts
    assert len(ax.patches) == 16 - 5  # one arrow per non-terminal state
    plt.close("all")
    no_grid = TabularMDP(mdp.P, mdp.R, mdp.terminal)
    with pytest.raises(ValueError, match="no grid"):
        plot_value_grid(V, no_grid)


def test_datum_rows_break_lines_at_newlines_and_width():
    from edurl.plotting import datum_rows, plot_datum_layout

    rows = datum_rows(["a", "\n", "b", "c", "d"], [0, 0, 1, 1, 0], width=2)
    assert rows == [[("a", 0.0), ("↵", 0.0)], [("b", 1.0), ("c", 1.0)], [("d", 0.0)]]
    with pytest.raises(ValueError, match="one mask entry per target token"):
        datum_rows(["a"], [1, 0])
    ax = plot_datum_layout(["a", "\n", "b"], [0, 0, 1])
    colours = [p.get_facecolor()[:3] for p in ax.patches]
    assert len(colours) == 3 and colours[0] == colours[1] != colours[2]
    plt.close("all")


def test_staleness_schedule_by_hand():
    from edurl.plotting import plot_staleness_timeline, staleness_schedule

    sync = staleness_schedule(0, steps=3, sample_seconds=2.0, train_seconds=1.0)
    assert list(sync["weights"]) == [0, 1, 2] and list(sync["staleness"]) == [0, 0, 0]
    assert list(sync["train_end"]) == [3.0, 6.0, 9.0]  # sample, then train: 3 s a step
    one = staleness_schedule(1, steps=4, sample_seconds=2.0, train_seconds=1.0)
    assert list(one["weights"]) == [0, 0, 1, 2] and list(one["staleness"]) == [0, 1, 1, 1]
    # batch 1 is sampled with the starting weights while batch 0 trains; then the sampler sets the pace: 2 s a step
    assert list(one["sample_start"]) == [0.0, 2.0, 4.0, 6.0]
    assert list(one["train_end"]) == [3.0, 5.0, 7.0, 9.0]
    two = staleness_schedule(2, steps=5, sample_seconds=1.0, train_seconds=2.0)
    assert list(two["staleness"]) == [0, 1, 2, 2, 2]
    assert list(two["train_end"]) == [3.0, 5.0, 7.0, 9.0, 11.0]  # the trainer never waits once it has started
    assert plot_staleness_timeline(one).get_title().startswith("4 steps in 9.0 s")
    with pytest.raises(ValueError, match="int >= 0"):
        staleness_schedule(-1)


def test_plot_grpo_metrics_smooths_training_metrics_and_marks_a_one_step_run():
    from edurl.plotting import plot_grpo_metrics

    panels = (("env/all/reward/total", "reward"), ("test/env/all/reward/total", "held-out"))
    long = pd.DataFrame({"step": [0, 1, 2], "env/all/reward/total": [0.0, 1.0, 2.0]})
    long["test/env/all/reward/total"] = [0.5, np.nan, 0.7]
    one = pd.DataFrame({"step": [0], "env/all/reward/total": [0.25], "test/env/all/reward/total": [0.5]})
    fig = plot_grpo_metrics({"long": long, "one": one}, panels=panels, smooth=2)
    train, test = fig.axes[0], fig.axes[1]
    (l_long, l_one), (t_long, t_one) = train.lines, test.lines
    assert np.allclose(l_long.get_ydata(), [0.0, 0.5, 1.5])  # rolling mean of 2, min_periods=1
    assert l_long.get_marker() in ("None", None, "")  # a curve of several steps is a line
    assert l_one.get_marker() == "o" and list(l_one.get_ydata()) == [0.25]  # one step: a visible point
    assert (
        list(t_long.get_xdata()) == [0, 2] and t_long.get_marker() == t_one.get_marker() == "o"
    )  # evaluations: points
    plt.close(fig)


def test_a_nan_inf_or_huge_value_reaches_only_the_windows_that_hold_it():
    """rolling_mean differenced a running sum: one NaN or inf made every later point NaN, and one value of 3e16
    swallowed the small values after it (their windows came out 0)."""
    np.testing.assert_allclose(rolling_mean([1, np.nan, 3, 4, 5], 2), [1, np.nan, np.nan, 3.5, 4.5])
    np.testing.assert_allclose(rolling_mean([1, np.inf, 3, 4], 1), [1, np.inf, 3, 4])
    np.testing.assert_allclose(rolling_mean([1, 0.9, 3e16, 0.8, 0.7, 0.6], 2)[-3:], [1.5e16, 0.75, 0.65])
    np.testing.assert_allclose(rolling_mean([2.0, 4.0, 6.0, np.inf], 10)[:3], [2, 3, 4])  # ragged start as before
    assert rolling_mean([], 3).shape == (0,)
    np.testing.assert_allclose(rolling_mean([1, 2, 3], np.int64(2)), [1, 1.5, 2.5])  # once "not a positive int"
    with pytest.raises(ValueError, match="window"):
        rolling_mean([1, 2], True)


def test_one_dataframe_is_one_seed_and_other_inputs_are_named():
    """A lone DataFrame was iterated as its column names: AttributeError 'str' object has no attribute 'columns'."""
    from edurl.plotting import plot_grpo_metrics

    df = pd.DataFrame({"step": [0, 1, 2], "r": [0.0, 1.0, 2.0]})
    grid, Y = align_curves(df, "step", "r", num_points=3)
    assert Y.shape == (1, 3)
    ax = plot_learning_curves({"ppo": df}, y="r", window=1)
    plt.close(ax.figure)
    with pytest.raises(TypeError, match="one DataFrame per seed"):
        align_curves([df, [1, 2]], "step", "r")
    with pytest.raises(ValueError, match="num_points"):  # 0 gave an empty grid
        align_curves([df], "step", "r", num_points=0)
    with pytest.raises(TypeError, match="label: DataFrame"):  # a list once failed on .items()
        plot_grpo_metrics([df, df])


def test_a_one_point_curve_has_a_marker():
    ax = plot_learning_curves([pd.DataFrame({"step": [5], "episode_return": [9.0]})], window=1)
    assert ax.lines[0].get_marker() == "o"
    plt.close(ax.figure)


def test_plot_value_grid_datum_layout_and_staleness_check_their_inputs():
    """A NumPy V raised "'numpy.ndarray' object has no attribute 'detach'", a policy of action indices a reshape
    error, an empty datum 'max() arg is an empty sequence', and staleness_schedule(steps=0) an IndexError when
    drawn (steps=-3 gave no rows)."""
    import gymnasium as gym
    import torch

    from edurl.plotting import plot_datum_layout, staleness_schedule
    from edurl.rl import TabularMDP

    mdp = TabularMDP.from_gymnasium(gym.make("FrozenLake-v1"))
    with pytest.raises(TypeError, match="torch.as_tensor"):
        plot_value_grid(np.zeros(16), mdp)
    with pytest.raises(ValueError, match="shape"):
        plot_value_grid(torch.zeros(15), mdp)
    with pytest.raises(ValueError, match="policy must"):
        plot_value_grid(torch.zeros(16), mdp, policy=torch.zeros(16, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one target token"):
        plot_datum_layout([], [])
    for steps in (0, -3, 2.5):
        with pytest.raises(ValueError, match="steps"):
            staleness_schedule(1, steps=steps)
    plt.close("all")


def test_plot_datum_layout_draws_tokens_as_text_not_maths():
    # a token with two '$' (a real tokenizer can have '$$') failed to draw: matplotlib read it as maths
    import io

    ax = plot_datum_layout(["x", "$$", "$y$"], [1, 1, 0])
    ax.figure.savefig(io.BytesIO(), format="png")
    assert [t.get_text() for t in ax.texts] == ["x", "$$", "$y$"]
    plt.close(ax.figure)


def test_a_curve_whose_values_stop_early_is_named_not_silently_cut():
    """A seed whose loss turned NaN halfway once cut every seed's curve at that step, without a word."""
    steps = np.arange(100)
    a = pd.DataFrame({"step": steps, "loss": np.ones(100)})
    b = pd.DataFrame({"step": steps, "loss": np.r_[np.ones(50), np.full(50, np.nan)]})
    with pytest.warns(UserWarning, match=r"curve 1's 'loss' has no value after step 49 .* runs to 99"):
        grid, _ = align_curves([a, b], "step", "loss", num_points=5)
    assert grid[-1] == 49
    # sparse logging (y on every other row, the last row without it) is not a stop
    sparse = pd.DataFrame({"step": steps, "loss": np.where(steps % 2 == 0, 1.0, np.nan)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grid, _ = align_curves([a, sparse], "step", "loss", num_points=5)
    assert grid[-1] == 98


def test_falsy_run_labels_are_still_labels():
    curve = [pd.DataFrame({"step": [0, 1, 2], "episode_return": [1.0, 2.0, 3.0]})]
    ax = plot_learning_curves({0: curve, 1: curve}, window=1)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["0 (1 seed)", "1 (1 seed)"]
    plt.close("all")


def test_plot_helpers_name_bad_arguments_before_drawing():
    """Each of these once failed inside pandas, NumPy or a loop with an error that named none of the arguments
    (or, for width <= 0 and k = True, drew something else without a word)."""
    import torch

    from edurl.plotting import datum_rows, plot_grpo_metrics, staleness_schedule

    m = pd.DataFrame({"step": [0, 1, 2], "env/all/correct": [0.1, 0.2, 0.3]})
    for smooth in (0, -1, 2.5, True, None):  # min_periods 1 must be <= window 0, ...
        with pytest.raises(ValueError, match="smooth must be a whole number of steps >= 1"):
            plot_grpo_metrics(m, smooth=smooth)
    with pytest.raises(ValueError, match="has no 'step' column"):  # KeyError "['step'] not in index"
        plot_grpo_metrics(pd.DataFrame({"env/all/correct": [0.1]}))
    with pytest.raises(ValueError, match="got no runs"):
        plot_grpo_metrics({})
    with pytest.warns(UserWarning, match="every panel is empty"):
        plot_grpo_metrics(pd.DataFrame({"step": [0], "loss": [1.0]}))
    plt.close("all")
    for width in (0, -3, 2.5):  # 0 and -3 put each token on its own line, 2.5 worked as 3
        with pytest.raises(ValueError, match="width must be a whole number of tokens per line"):
            datum_rows(["a", "b", "c"], [1, 0, 1], width=width)
    for k in (True, False):  # taken as 1 and 0
        with pytest.raises(ValueError, match="max_steps_off_policy must be an int >= 0"):
            staleness_schedule(k)
    with pytest.raises(ValueError, match="durations must be finite"):
        staleness_schedule(1, sample_seconds=float("inf"))
    # bfloat16 values (a model's dtype) drew nothing: NumPy has no bfloat16
    import gymnasium as gym

    from edurl.rl import TabularMDP, value_iteration

    mdp = TabularMDP.from_gymnasium(gym.make("FrozenLake-v1"))
    V = value_iteration(mdp, 0.9)[0]
    ax = plot_value_grid(V.to(torch.bfloat16), mdp)
    assert ax.images[0].get_array().shape == (4, 4)
    plt.close("all")
