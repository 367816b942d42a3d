"""benchmarks/gpu_check.py (``make gpu-check``): what runs without a GPU.

On a machine without an NVIDIA GPU the script must say so and exit 0 having run nothing; its
throughput functions must still run on the CPU at tiny sizes, so that the code a GPU run depends on
is exercised on every machine.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # hides any GPU from torch
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "gpu-check: no NVIDIA GPU found (torch.cuda.is_available() is False" in proc.stdout
    assert "nothing run" in proc.stdout
    assert not out.exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_target_runs_the_script():
    # run as CI does, from inside `make test`: drop the outer make's settings, which add "Entering directory" lines
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", "gpu-check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert any(line.endswith("benchmarks/gpu_check.py") for line in proc.stdout.splitlines()), proc.stdout


def test_ppo_throughput_runs_on_the_cpu(gpu_check):
    r = gpu_check.ppo_throughput("cpu", num_envs=4, num_steps=8, updates=2, rollouts=2)
    assert r["ppo_env_steps_per_s"] > 0 and r["rollout_env_steps_per_s"] > 0
    assert r["num_envs"] == 4 and r["device"] == "cpu"
    many = gpu_check.ppo_throughput("cpu", num_envs=4, num_steps=8, updates=2, rollouts=2, num_seeds=3)
    assert many["num_seeds"] == 3 and many["ppo_env_steps_per_s"] > 0


def test_llm_throughput_runs_on_the_cpu(gpu_check):
    tiny = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=256,
        max_position_embeddings=64,
    )
    r = gpu_check.llm_throughput("cpu", tiny, num_prompts=2, num_samples=2, prompt_len=8, max_tokens=4, lora_rank=2)
    assert r["sampled_tokens"] == 2 * 2 * 4  # no stop sequence: every completion runs to max_tokens
    assert r["sampler_tokens_per_s"] > 0 and r["grpo_step_seconds"] > 0
    assert r["dtype"] == "float32" and 0 < r["trainable_parameters"] < r["parameters"]


def test_a_failing_check_is_reported_and_the_others_still_run(gpu_check, capsys):
    def broken():
        raise RuntimeError("CUDA out of memory")

    rows = [gpu_check.run_check("broken", broken), gpu_check.run_check("fine", lambda: (True, "1 passed", {}))]
    assert [r["ok"] for r in rows] == [False, True]
    assert rows[0]["result"] == "error: RuntimeError: CUDA out of memory"
    assert "Traceback" in rows[0]["details"]["traceback"]
    table = gpu_check.format_table(rows)
    assert "broken" in table and "FAILED" in table and "1 passed" in table
    json.dumps(rows)  # the JSON report holds these rows as they are


def test_junit_counts_per_file(gpu_check, tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        "<testsuites><testsuite>"
        '<testcase classname="a" file="notebooks/01.ipynb" name="Cell 0"/>'
        '<testcase classname="a" file="notebooks/01.ipynb" name="Cell 1"><failure message="x"/></testcase>'
        '<testcase classname="b" file="notebooks/02.ipynb" name="Cell 0"/>'
        '<testcase classname="c" file="tests/t.py" name="t"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    c = gpu_check.junit_counts(xml)
    assert (c["passed"], c["failed"], c["skipped"]) == (2, 1, 1)
    assert c["files"] == {"notebooks/01.ipynb": "failed", "notebooks/02.ipynb": "passed", "tests/t.py": "skipped"}
