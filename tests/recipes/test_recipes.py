import subprocess
import sys

import pytest

from edurl import load_metrics
from edurl.llm import GRPOConfig, SFTConfig
from edurl.llm.model import TinyLMConfig
from edurl.recipes import a2c_cartpole, gae_visualizer, ppo_cartpole, reinforce_cartpole
from edurl.recipes._cli import field_docs, parse_config
from edurl.recipes.tinker_rl_loop import TinkerLoopConfig
from edurl.rl import A2CConfig, PPOConfig, ReinforceConfig


def test_parse_config_types_and_dashes():
    cfg = parse_config(
        ReinforceConfig,
        [
            "--learning-rate",
            "0.005",
            "--episodes-per-update=4",
            "--no-normalize-advantages",
            "--hidden-sizes",
            "32",
            "32",
            "--device",
            "None",
        ],
    )
    assert cfg.learning_rate == 0.005 and cfg.episodes_per_update == 4 and cfg.normalize_advantages is False
    assert cfg.hidden_sizes == (32, 32) and cfg.device is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "1"], "Unrecognized options: --lr"),
        (["--learning-rate", "fast"], "could not convert string to float"),
        (["--learning-rate"], "Missing value"),
    ],
)
def test_parse_config_errors_are_readable(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(ReinforceConfig, argv)
    assert message in " ".join(capsys.readouterr().err.split())


def test_grpo_nested_overrides_and_help(capsys):
    cfg = parse_config(
        GRPOConfig, ["--sft.num-digits", "3", "--loss-fn", "ppo", "--clip-high-threshold", "1.28"], save_every=50
    )
    assert cfg.sft.num_digits == 3 and isinstance(cfg.sft.num_digits, int) and cfg.loss_fn == "ppo"
    assert cfg.clip_high_threshold == 1.28 and cfg.save_every == 50
    with pytest.raises(SystemExit):  # the old parser built SFTConfig(num_digits="3") from this
        parse_config(GRPOConfig, ["--sft", "3"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parse_config(GRPOConfig, ["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--sft.num-digits INT" in out and "Task difficulty: operands have up to this many digits (1 to 9)." in out
    assert "--sft.model.hidden-size" in out and f"(default: {GRPOConfig.max_steps})" in out
    assert "_MISSING_TYPE" not in out and "MISSING" not in out


def test_under_torchrun_only_the_data_parallel_recipe_runs(monkeypatch, capsys):
    """reinforce_cartpole under torchrun trained the same run once per rank, each writing the same files."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as stopped:
        parse_config(ReinforceConfig, [])
    assert stopped.value.code == 2
    assert "WORLD_SIZE=2: this recipe runs in one process" in capsys.readouterr().err
    assert parse_config(GRPOConfig, [], data_parallel=True).group_size == GRPOConfig.group_size
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert isinstance(parse_config(ReinforceConfig, []), ReinforceConfig)


def test_a_value_the_config_refuses_is_reported_with_its_reason(capsys):
    with pytest.raises(SystemExit):
        parse_config(GRPOConfig, ["--group-size", "1"])
    assert "group_size must be >= 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    "cls, argv, flag",
    [
        (PPOConfig, ["--device", "cuda:99"], "--device cuda:99"),
        (GRPOConfig, ["--sft.device", "cuda:99"], "--sft.device cuda:99"),
        (GRPOConfig, ["--device", "tpu"], "--device tpu"),
    ],
)
def test_a_device_this_machine_lacks_exits_with_the_reason_before_training(cls, argv, flag, capsys):
    # cuda:99 is refused on every machine: without CUDA, or past its device count
    with pytest.raises(SystemExit) as exit_:
        parse_config(cls, argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: ") and ("cuda" in err or "unknown device" in err)
    assert "Traceback" not in err


def test_a_log_dir_a_recipe_cannot_use_is_one_line_before_any_work(tmp_path, capsys):
    """A file as --log-dir was a FileExistsError from inside the logger (CartPole recipes); GRPO's own refusals
    (an earlier run's checkpoints, a resume of nothing) came under a traceback."""
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    for recipe in (ppo_cartpole, reinforce_cartpole, a2c_cartpole):
        for log_dir, reason in [(afile, "is a file"), (afile / "run", f"lies under {str(afile)!r}, which is a file")]:
            with pytest.raises(SystemExit) as exit_:  # under a file: a NotADirectoryError traceback, after training
                recipe.main(["--log-dir", str(log_dir)])
            err = capsys.readouterr().err
            assert exit_.value.code == 2 and reason in err and "Traceback" not in err, err
    assert afile.read_text() == "keep me"
    from edurl.recipes import grpo_arithmetic

    run = tmp_path / "grpo"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "state.pt").write_bytes(b"")
    with pytest.raises(SystemExit) as exit_:
        grpo_arithmetic.main(["--log-dir", str(run), "--max-steps", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: log_dir") and "--resume" in err and "Traceback" not in err


def test_a_base_model_path_that_is_not_a_checkpoint_is_one_line_before_any_work(tmp_path, capsys):
    """A mistyped --base-model ended in a traceback, after the task and the course's SFT start were set up."""
    from edurl.recipes import grpo_arithmetic

    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("")
    for path, reason in [
        ("./no-such-folder", "does not exist"),
        (str(tmp_path / "empty"), "a folder without a config.json"),
        (str(tmp_path / "afile"), "is a file"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            grpo_arithmetic.main(["--base-model", path, "--log-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("error: --base-model: ") and reason in err, err
    assert not (tmp_path / "run").exists()


def test_grpo_recipe_help_runs_as_a_module():
    out = subprocess.run(
        [sys.executable, "-m", "edurl.recipes.grpo_arithmetic", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "--sft.num-digits" in out.stdout and "_MISSING_TYPE" not in out.stdout


def test_every_config_field_is_documented():
    for cls in (
        ReinforceConfig,
        A2CConfig,
        PPOConfig,
        gae_visualizer.GAEVisualizerConfig,
        GRPOConfig,
        SFTConfig,
        TinyLMConfig,
        TinkerLoopConfig,
    ):
        docs = field_docs(cls)
        assert set(docs) == set(cls.__dataclass_fields__), cls.__name__


def test_help_lists_fields(capsys):
    with pytest.raises(SystemExit):
        parse_config(A2CConfig, ["--help"])
    assert "--lam FLOAT" in capsys.readouterr().out


def test_reinforce_recipe_writes_metrics_and_png(tmp_path):
    reinforce_cartpole.main(["--max-episodes", "16", "--log-dir", str(tmp_path), "--no-progress"])
    assert (tmp_path / "learning_curve.png").stat().st_size > 1000
    assert load_metrics(tmp_path)["episodes"].iloc[-1] == 16


def test_a2c_recipe_runs_as_a_module(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "edurl.recipes.a2c_cartpole",
            "--total-steps",
            "1024",
            "--log-dir",
            str(tmp_path),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "learning curve" in out.stdout and (tmp_path / "learning_curve.png").exists()


def test_gae_visualizer_writes_png(tmp_path):
    png = tmp_path / "gae.png"
    gae_visualizer.main(["--train-episodes", "8", "--out", str(png)])
    assert png.stat().st_size > 1000


def test_gae_visualizer_writes_where_it_says(tmp_path, capsys):
    """--out NAME wrote NAME.png and printed NAME; a folder wrote FOLDER.png beside it; a missing parent folder
    failed after training."""
    written = gae_visualizer.main(["--train-episodes", "2", "--out", str(tmp_path / "new dir" / "plot")])
    assert written == str(tmp_path / "new dir" / "plot.png") and (tmp_path / "new dir" / "plot.png").is_file()
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {written}")
    with pytest.raises(SystemExit):
        parse_config(gae_visualizer.GAEVisualizerConfig, ["--out", str(tmp_path)])
    box = str.maketrans("│|", "  ")  # tyro's box (ASCII where the locale is not UTF-8) wraps long lines
    err = " ".join(capsys.readouterr().err.translate(box).split())
    assert "is a folder; name the PNG" in err


def test_gae_visualizer_out_with_a_dot_or_a_slash(tmp_path, capsys):
    """--out gae_gamma0.99 has the suffix '.99': savefig refused it after the training. --out figs/ wrote figs/.png."""
    config = parse_config(gae_visualizer.GAEVisualizerConfig, ["--out", str(tmp_path / "gae_gamma0.99")])
    assert config.out == str(tmp_path / "gae_gamma0.99.png")
    assert parse_config(gae_visualizer.GAEVisualizerConfig, ["--out", "a.pdf"]).out == "a.pdf"
    assert gae_visualizer.GAEVisualizerConfig(out=tmp_path / "g").out == str(tmp_path / "g.png")  # a Path too
    with pytest.raises(SystemExit):
        parse_config(gae_visualizer.GAEVisualizerConfig, ["--out", str(tmp_path / "not yet") + "/"])
    box = str.maketrans("│|", "  ")
    assert "is a folder; name the PNG" in " ".join(capsys.readouterr().err.translate(box).split())


def test_a_figure_path_under_a_file_is_named(tmp_path, capsys):
    """--out notes.txt/gae.png trained the policy, then failed in save_figure's mkdir with a bare
    NotADirectoryError; save_figure itself said no more, and closed the figure it could not save."""
    import matplotlib.pyplot as plt

    from edurl.recipes._cli import save_figure

    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit):
        parse_config(gae_visualizer.GAEVisualizerConfig, ["--out", str(tmp_path / "notes.txt" / "gae.png")])
    box = str.maketrans("│|", "  ")  # tyro's box wraps a long path anywhere, mid-word too: compare without spaces
    assert "notes.txt'isafile;nameaPNGinafolder" in "".join(capsys.readouterr().err.translate(box).split())
    fig = plt.figure()
    try:
        with pytest.raises(NotADirectoryError, match="lies under .*notes.txt', which is a file. Pass a path"):
            save_figure(fig, tmp_path / "notes.txt" / "figs" / "f.png")
        assert plt.fignum_exists(fig.number)  # still open, to be saved elsewhere
        assert save_figure(fig, tmp_path / "f.png").is_file()
    finally:
        plt.close(fig)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_a_recipe_run_from_a_notebook_leaves_its_figures_on(tmp_path):
    """Each recipe's main() called matplotlib.use("Agg"), which switched a notebook's inline backend off for the
    rest of the session: notebook 07 runs tinker_rl_loop.main in-process, and its later figures showed nothing.
    Here another backend stands in for the notebook's; the recipes must leave it, and close the figures they save."""
    import matplotlib
    import matplotlib.pyplot as plt

    from edurl.recipes._cli import save_figure

    plt.close("all")
    matplotlib.use("svg")
    try:
        gae_visualizer.main(["--train-episodes", "2", "--out", str(tmp_path / "gae.png")])
        reinforce_cartpole.main(["--max-episodes", "8", "--log-dir", str(tmp_path / "r"), "--no-progress"])
        fig = plt.figure()
        assert save_figure(fig, tmp_path / "deep" / "f.png").is_file()
        assert matplotlib.get_backend() == "svg" and not plt.get_fignums()
    finally:
        matplotlib.use("Agg")


def test_ppo_recipe_on_the_torch_env(tmp_path):
    ppo_cartpole.main(["--env-backend", "torch", "--total-steps", "2560", "--log-dir", str(tmp_path), "--no-progress"])
    assert (tmp_path / "learning_curve.png").exists()
    assert "optim/approx_kl_k3" in load_metrics(tmp_path)


@pytest.mark.parametrize("recipe, metric", [(ppo_cartpole, "optim/approx_kl_k3"), (a2c_cartpole, "optim/value_loss")])
def test_trainer_recipes_with_several_seeds(tmp_path, capsys, recipe, metric):
    """--num-seeds 3: one process, one metrics folder per seed, one line per seed, one PNG with the band."""
    args = ["--env-backend", "torch", "--total-steps", "1024", "--num-seeds", "3", "--seed", "4"]
    results = recipe.main([*args, "--log-dir", str(tmp_path), "--no-progress"])
    assert [r.config.seed for r in results] == [4, 5, 6]
    out = capsys.readouterr().out
    assert all(f"seed {s}: " in out for s in (4, 5, 6)) and (tmp_path / "learning_curve.png").exists()
    assert all(metric in load_metrics(tmp_path / f"seed{s}") for s in (4, 5, 6))


def test_the_learning_curve_shows_a_seed_that_ran_on_after_the_others_stopped():
    # the band covers only the steps every seed ran; a seed left unsolved there once vanished from the PNG
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from edurl.recipes._cli import draw_learning_curve
    from edurl.rl.episodes import TrainResult

    def result(last_step, ret, seed):
        steps = list(range(1000, last_step + 1, 100))
        rows = pd.DataFrame({"episode": range(len(steps)), "step": steps, "episode_return": [ret] * len(steps)})
        rows["episode_length"], rows["time/total"] = rows["episode_return"], 0.0
        return TrainResult.from_episodes(rows.to_dict("records"), PPOConfig(seed=seed, progress=False), None, None)

    solved, unsolved = result(30_000, 500.0, 0), result(200_000, 20.0, 1)
    assert solved.solved and not unsolved.solved
    ax = draw_learning_curve([solved, unsolved], "PPO")
    reach = max(max(line.get_xdata()) for line in ax.lines if len(line.get_xdata()) > 2)
    assert reach == 200_000
    assert "each seed" in ax.get_legend_handles_labels()[1]
    plt.close(ax.figure)


def test_the_learning_curve_of_seeds_with_no_steps_in_common_or_no_episode():
    """A seed that solved before another finished its first episode, or a seed with no episode at all, used to
    raise in the plot, after training and before the recipe printed its report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from edurl.recipes._cli import draw_learning_curve
    from edurl.rl.episodes import TrainResult

    def result(first_step, last_step, ret, seed):
        steps = list(range(first_step, last_step + 1, 100))
        rows = pd.DataFrame({"episode": range(len(steps)), "step": steps, "episode_return": [ret] * len(steps)})
        rows["episode_length"], rows["time/total"] = rows["episode_return"], 0.0
        return TrainResult.from_episodes(rows.to_dict("records"), PPOConfig(seed=seed, progress=False), None, None)

    early, late = result(100, 1_000, 500.0, 0), result(2_000, 3_000, 20.0, 1)
    ax = draw_learning_curve([early, late], "PPO")
    assert "share no steps" in ax.get_title()
    drawn = [line for line in ax.lines if len(line.get_xdata()) > 2]
    assert [(min(line.get_xdata()), max(line.get_xdata())) for line in drawn] == [(100, 1_000), (2_000, 3_000)]
    plt.close(ax.figure)
    none = result(100, 0, 0.0, 2)  # no rows: no episode finished
    ax = draw_learning_curve([early, none], "PPO")
    assert "no steps" in ax.get_title() and "total_steps" in ax.get_title()
    plt.close(ax.figure)
    ax = draw_learning_curve(none, "PPO")
    assert "no episode finished" in ax.get_title()
    plt.close(ax.figure)


def test_a_recipe_whose_seed_finished_no_episode_still_reports(tmp_path, capsys):
    """The helper's case: 64 env steps of 2 seeds on 2 envs; one seed ends no episode."""
    args = ["--env-backend", "torch", "--total-steps", "64", "--num-envs", "2", "--num-steps", "32"]
    ppo_cartpole.main([*args, "--num-seeds", "2", "--log-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert "seed 0: " in out and "seed 1: " in out and (tmp_path / "learning_curve.png").exists()
    assert "not solved: no episode finished" in out  # the seed whose curve was empty
    # a short run's report counts the episodes it averages (it said "last 100-episode mean" over 3 episodes)
    (line,) = [x for x in out.splitlines() if "episode mean return" in x]
    n = int(line.split("last ")[1].split("-episode")[0])
    assert 1 <= n < 100
    ppo_cartpole.main([*args, "--log-dir", "None", "--no-progress"])
    assert "not saved (log_dir is None)" in capsys.readouterr().out


def test_the_grpo_recipe_warns_once_about_an_earlier_runs_metrics(tmp_path, monkeypatch):
    """The recipe's early look at log_dir (for its one-line refusals) gave train_grpo's warning a second time."""
    import warnings

    from edurl.recipes import grpo_arithmetic

    monkeypatch.setenv("EDURL_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    tiny = (
        "--sft.model.hidden-size 16 --sft.model.num-layers 1 --sft.model.num-heads 2 --sft.model.intermediate-size 32 "
        "--sft.max-steps 2 --sft.extra-steps 0 --sft.batch-size 8 --sft.warmup-steps 1 --sft.num-threads 1 "
        "--group-size 2 --batch-size 2 --max-tokens 12 --eval-every 1 --num-eval 2 --num-threads 1 --no-progress "
        "--save-every 0 --max-steps 1"
    ).split()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        grpo_arithmetic.main([*tiny, "--log-dir", str(run)])
    assert sum("holds an earlier run's metrics.jsonl" in str(w.message) for w in seen) == 1


def test_the_learning_curve_smooths_over_the_solve_window():
    """The curve was always a rolling mean of 100 while the 'solved' line and marker used solve_window: with
    solve_window=10 a run solved at a step where the drawn curve stood at 68."""
    import matplotlib.pyplot as plt
    import pandas as pd

    from edurl.recipes._cli import draw_learning_curve
    from edurl.rl.episodes import TrainResult

    returns = [20.0] * 90 + [500.0] * 10
    rows = pd.DataFrame({"episode": range(100), "step": range(100, 10_001, 100), "episode_return": returns})
    rows["episode_length"], rows["time/total"] = rows["episode_return"], 0.0
    config = PPOConfig(seed=0, progress=False, solve_window=10)
    result = TrainResult.from_episodes(rows.to_dict("records"), config, None, None)
    assert result.solved
    ax = draw_learning_curve(result, "PPO")
    assert ax.lines[0].get_ydata()[-1] == 500.0 and "rolling mean of 10" in ax.get_ylabel()
    plt.close(ax.figure)
