import subprocess
import sys

import pytest

from edurl import load_metrics
from edurl.recipes import gae_visualizer, ppo_cartpole, reinforce_cartpole
from edurl.recipes._cli import field_docs, parse_config
from edurl.rl import A2CConfig, PPOConfig, ReinforceConfig


def test_parse_config_types_and_dashes():
    cfg = parse_config(ReinforceConfig, ["--lr", "0.005", "--episodes-per-update=4", "--normalize", "false",
                                         "--hidden_sizes", "32,32", "--device", "none"])
    assert cfg.lr == 0.005 and cfg.episodes_per_update == 4 and cfg.normalize is False
    assert cfg.hidden_sizes == (32, 32) and cfg.device is None


def test_parse_config_errors_are_readable():
    with pytest.raises(SystemExit, match="unknown field --learning-rate"):
        parse_config(ReinforceConfig, ["--learning-rate", "1"])
    with pytest.raises(SystemExit, match="cannot read 'fast' as float"):
        parse_config(ReinforceConfig, ["--lr", "fast"])
    with pytest.raises(SystemExit, match="needs a value"):
        parse_config(ReinforceConfig, ["--lr"])


def test_every_config_field_is_documented():
    for cls in (ReinforceConfig, A2CConfig, PPOConfig, gae_visualizer.GAEVisualizerConfig):
        docs = field_docs(cls)
        assert set(docs) == set(cls.__dataclass_fields__), cls.__name__


def test_help_lists_fields(capsys):
    with pytest.raises(SystemExit):
        parse_config(A2CConfig, ["--help"])
    assert "--lam" in capsys.readouterr().out


def test_reinforce_recipe_writes_metrics_and_png(tmp_path):
    reinforce_cartpole.main(["--max-episodes", "16", "--log-dir", str(tmp_path), "--progress", "false"])
    assert (tmp_path / "learning_curve.png").stat().st_size > 1000
    assert load_metrics(tmp_path)["episodes"].iloc[-1] == 16


def test_a2c_recipe_runs_as_a_module(tmp_path):
    out = subprocess.run([sys.executable, "-m", "edurl.recipes.a2c_cartpole", "--total-steps", "1024",
                          "--log-dir", str(tmp_path), "--progress", "false"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "learning curve" in out.stdout and (tmp_path / "learning_curve.png").exists()


def test_gae_visualizer_writes_png(tmp_path):
    png = tmp_path / "gae.png"
    gae_visualizer.main(["--train-episodes", "8", "--out", str(png)])
    assert png.stat().st_size > 1000


def test_ppo_recipe_on_the_torch_env(tmp_path):
    ppo_cartpole.main(["--env-backend", "torch", "--total-steps", "2560", "--log-dir", str(tmp_path),
                       "--progress", "false"])
    assert (tmp_path / "learning_curve.png").exists()
    assert "optim/approx_kl_k3" in load_metrics(tmp_path)
