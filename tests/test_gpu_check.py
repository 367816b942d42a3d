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
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
TINY_QWEN = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=512,  # room past the byte-level BPE tokenizer's 283 tokens for the random prompt ids
    max_position_embeddings=64,
)


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


@pytest.mark.skipif(sys.platform == "win32", reason="the fake nvidia-smi is a shell script")
@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or __import__("torch").cuda.is_available(), reason="needs no CUDA"
)
def test_a_gpu_that_this_torch_cannot_use_is_an_error_not_a_pass(tmp_path):
    # a venv built with the CPU torch on a GPU machine used to print "no NVIDIA GPU found" and exit 0
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{fake.parent}{os.pathsep}{env['PATH']}"
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "nvidia-smi lists a GPU (GPU 0: NVIDIA H100" in proc.stderr
    assert ("is a CPU build" in proc.stderr) == (torch.version.cuda is None)
    assert not out.exists()
    hidden = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)], cwd=tmp_path, env={**env, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert hidden.returncode == 0 and "no NVIDIA GPU found" in hidden.stdout  # GPUs hidden on purpose: nothing to check


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
    r = gpu_check.llm_throughput(
        "cpu", TINY_QWEN, num_prompts=2, num_samples=2, prompt_len=8, max_tokens=4, lora_rank=2
    )
    assert r["sampled_tokens"] == 2 * 2 * 4  # no stop sequence: every completion runs to max_tokens
    assert r["sampler_tokens_per_s"] > 0 and r["grpo_step_seconds"] > 0
    assert r["dtype"] == "float32" and 0 < r["trainable_parameters"] < r["parameters"]


def test_sampler_profile_runs_on_the_cpu(gpu_check):
    r = gpu_check.sampler_profile(
        "cpu", TINY_QWEN, num_prompts=2, num_samples=2, prompt_len=8, max_tokens=4, lora_rank=2
    )
    assert r["sequences"] == 4 and r["decode_step_ms"] > 0 and r["cpu_ms_per_forward"] > 0
    assert r["kernel_launches_per_forward"] == 0 and r["device_busy_ms_per_forward"] == 0  # no GPU, no kernels
    assert "aten::" in r["table"]


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


def test_progress_counts_read_a_cut_off_xdist_run(gpu_check):
    # lines as an H100 run printed them (2026-11-27), cut off by the time limit inside notebook 10
    output = "\n".join(
        [
            "notebooks/08_rlhf::ipynb::Cell 8 ",
            "[gw6] [ 73%] PASSED notebooks/08_rlhf::ipynb::Cell 8 ",
            "notebooks/08_rlhf::ipynb::Cell 9 ",
            "[gw6] [ 74%] FAILED notebooks/08_rlhf::ipynb::Cell 9 ",
            "[gw6] [ 74%] PASSED notebooks/08_rlhf::ipynb::Cell 10 ",
            "[gw1] [ 98%] PASSED notebooks/10_off_policy_and_scale::ipynb::Cell 15 ",
            "notebooks/10_off_policy_and_scale::ipynb::Cell 16 ",
            "tests/t.py::test_x SKIPPED (needs a GPU)",
            "PASSED tests/llm/test_sampling.py::test_sampler_on_cuda",
            "=========================== short test summary info ============================",
            "FAILED notebooks/08_rlhf.ipynb::Cell 9",  # the summary repeats a failure: not a second one
        ]
    )
    c = gpu_check.progress_counts(output)
    assert (c["passed"], c["failed"], c["skipped"]) == (4, 1, 1)
    assert c["files"] == {
        "notebooks.08_rlhf.ipynb": "failed",
        "notebooks.10_off_policy_and_scale.ipynb": "passed",
        "tests.t.py": "skipped",
        "tests.llm.test_sampling.py": "passed",
    }
    assert (
        c["finished"]["notebooks.08_rlhf.ipynb"] == 3 and c["finished"]["notebooks.10_off_policy_and_scale.ipynb"] == 1
    )


def test_a_run_cut_off_by_its_timeout_keeps_its_counts_and_each_failure(gpu_check, tmp_path):
    """A notebook whose second cell fails and whose third never ends: the run is killed, and what finished, the
    failing cell's source, what it printed and its assert are all still there."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("x = 0.05"),
        nbformat.v4.new_code_cell('print(f"gold overshoot {x}")\nassert x >= 0.1  # 10 study seeds: min 0.296'),
        nbformat.v4.new_code_cell("import time\ntime.sleep(600)"),
    ]
    path = tmp_path / "cut.ipynb"
    nbformat.write(nb, str(path))
    failures = tmp_path / "failures"
    args = ["-p", "book.nbcapture", "--nbval-lax", "--nbval-current-env", str(path)]
    r = gpu_check.run_pytest(args, timeout=45, failures_dir=failures)
    assert r["timed_out"] and r["returncode"] is None, r["output_tail"]
    assert (r["passed"], r["failed"]) == (1, 1), r["output_tail"]
    assert len(r["failures"]) == 1
    text = Path(r["failures"][0]).read_text(encoding="utf-8")
    assert "Cell 1" in text and "assert x >= 0.1  # 10 study seeds" in text  # the id and the cell's source
    assert "gold overshoot 0.05" in text  # what it printed before the assert
    assert "AssertionError" in text


def test_notebooks_are_chosen_by_number_or_path(gpu_check):
    everything = gpu_check.select_notebooks(None)
    assert [p.name[:2] for p in everything] == [f"{n:02d}" for n in range(1, len(everything) + 1)]
    eight = REPO / "notebooks" / "08_rlhf.ipynb"
    assert gpu_check.select_notebooks(["06", "08", str(eight)]) == [everything[5], eight]  # each once, in order
    with pytest.raises(ValueError, match=r"no notebook matches '99'.*one of 01, 02"):
        gpu_check.select_notebooks(["99"])


def test_a_wrong_notebook_number_is_refused_before_anything_runs(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "notebooks", "--notebooks", "6", "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "no notebook matches '6'" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_the_notebooks_check_runs_only_the_chosen_ones(gpu_check, monkeypatch):
    seen = {}

    def fake_run_pytest(args, timeout, env=None, failures_dir=None):
        seen["args"] = args
        return {"returncode": None, "timed_out": True, "passed": 3, "failed": 0, "files": {}, "finished": {}}

    monkeypatch.setattr(gpu_check, "run_pytest", fake_run_pytest)
    eight = REPO / "notebooks" / "08_rlhf.ipynb"
    ok, result, details = gpu_check.check_notebooks(60, 1, None, [eight])
    assert str(eight) in seen["args"] and "notebooks/" not in seen["args"]
    assert not ok and details["notebooks"] == {"notebooks.08_rlhf.ipynb": "unfinished"}  # only it is reported
    assert "unfinished: 08_rlhf.ipynb (0 of" in result
