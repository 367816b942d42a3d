"""The cookbook-style loop (edurl.recipes.tinker_rl_loop), unmodified, against edurl.serve: its own process,
its key from TINKER_API_KEY, as a learner runs it."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from edurl import load_metrics

from .conftest import KEY


def test_the_cookbook_style_loop_runs_against_the_server_on_policy(server_url, tmp_path):
    log_dir = tmp_path / "loop"
    args = ["--base-url", server_url, "--max-steps", "3", "--batch-size", "6", "--group-size", "4"]
    args += ["--num-eval", "16", "--eval-every", "2", "--log-dir", str(log_dir), "--no-progress"]
    env = {**os.environ, "TINKER_API_KEY": KEY, "EDURL_MAX_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "edurl.recipes.tinker_rl_loop", *args], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out pass@1:" in proc.stdout
    assert (log_dir / "learning_curves.png").stat().st_size > 10_000
    m = load_metrics(log_dir)
    assert list(m["step"]) == [0, 1, 2]  # one row per step, as train_grpo writes them
    assert m["test/start_pass_at_1"].notna().tolist() == [True, False, False]
    assert m["test/pass_at_1"].notna().tolist() == [False, True, True]  # after every 2 steps, and after the last
    trained = m.dropna(subset=["optim/loss"])
    assert len(trained) >= 2 and all(math.isfinite(v) for v in trained["optim/loss"])
    # on-policy every step: the training log-probs equal the sampler's (float rounding only)
    assert (trained["optim/logprob_diff_max"] < 1e-4).all(), trained["optim/logprob_diff_max"]


def test_the_loop_with_dro_sends_its_beta(server_url, tmp_path):
    """--loss-fn dro sent no loss_fn_config, and dro's beta has no default: the server's forward_backward failed
    (now the loop sends {"beta": --dro-beta}, and a request without it is a 400 that names beta)."""
    log_dir = tmp_path / "dro"
    args = ["--base-url", server_url, "--max-steps", "2", "--batch-size", "6", "--group-size", "4", "--loss-fn", "dro"]
    args += ["--dro-beta", "0.1", "--num-eval", "8", "--eval-every", "2", "--log-dir", str(log_dir), "--no-progress"]
    env = {**os.environ, "TINKER_API_KEY": KEY, "EDURL_MAX_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "edurl.recipes.tinker_rl_loop", *args], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = load_metrics(log_dir).dropna(subset=["optim/loss"])
    assert len(trained) >= 1 and all(math.isfinite(v) for v in trained["optim/loss"])


def test_a_bad_value_on_the_command_line_is_refused_with_its_reason(server_url):
    env = {**os.environ, "TINKER_API_KEY": KEY}
    proc = subprocess.run(
        [sys.executable, "-m", "edurl.recipes.tinker_rl_loop", "--base-url", server_url, "--group-size", "1"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "group_size must be >= 2" in proc.stderr


def test_no_server_or_no_key_is_one_line_at_once(tmp_path, monkeypatch, capsys):
    """Without a server the SDK retried for about five minutes in silence, then printed a long traceback; without
    TINKER_API_KEY it raised from inside the SDK."""
    import socket
    import time

    from edurl.recipes import tinker_rl_loop

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        tinker_rl_loop.main(["--base-url", f"http://127.0.0.1:{port}", "--log-dir", str(tmp_path)])
    assert exit_.value.code == 2 and time.perf_counter() - t0 < 30
    assert "no server answers" in capsys.readouterr().err
    monkeypatch.delenv("TINKER_API_KEY")
    with pytest.raises(SystemExit) as exit_:
        tinker_rl_loop.main(["--base-url", f"http://127.0.0.1:{port}", "--log-dir", str(tmp_path)])
    assert exit_.value.code == 2 and "set TINKER_API_KEY" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"max_steps": 0}, "max_steps"),
        ({"loss_fn": "cross_entropy"}, "loss_fn"),
        # these three were accepted; at temperature 0 every group is uniform and the run trained on nothing
        ({"temperature": 0.0}, "temperature must be > 0.*uniform"),
        # the server scores at 1 (Tinker's forward_backward has no temperature): samples at 0.7 were off-policy
        ({"temperature": 0.7}, "temperature must be 1.0 here.*takes no temperature"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"seed": -3}, "seed"),
        ({"adam_eps": 0.0}, "adam_eps"),
        # these were taken as counts: True as 1, 2.5 until a range() failed, NaN and inf never below 1
        ({"batch_size": True}, "TinkerLoopConfig.batch_size must be a positive int, got True"),
        ({"max_steps": 2.5}, "TinkerLoopConfig.max_steps must be a positive int, got 2.5"),
        ({"num_eval": float("nan")}, "TinkerLoopConfig.num_eval must be a positive int, got nan"),
        ({"eval_every": float("inf")}, "TinkerLoopConfig.eval_every must be a positive int, got inf"),
        ({"temperature": True}, "TinkerLoopConfig.temperature must be a finite number, got True"),
        ({"log_dir": 3}, "TinkerLoopConfig.log_dir must be a folder path, got 3"),
        ({"log_dir": ""}, "TinkerLoopConfig.log_dir must be a folder path"),
        ({"base_url": "127.0.0.1:8000"}, "base_url must be an address with its scheme, e.g. http://127.0.0.1:8000"),
    ],
)
def test_config_refuses_bad_values(kwargs, match):
    from edurl.recipes.tinker_rl_loop import TinkerLoopConfig

    with pytest.raises(ValueError, match=match):
        TinkerLoopConfig(**kwargs)
