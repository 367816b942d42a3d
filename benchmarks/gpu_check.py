"""``make gpu-check``: everything the course claims about a CUDA GPU, checked in one command (about 10 to 15 minutes).

Four checks (and a profile on request), each isolated (one that fails or crashes is reported, and the others still run):

==============  =========================================================================================
check           what it runs
==============  =========================================================================================
cuda-tests      ``pytest -m cuda tests``: the unit tests that need a GPU (skipped everywhere else)
notebooks       every notebook under nbval with ``EDURL_DEVICE=cuda``
ppo             PPO env steps/s with ``TorchCartPole`` (4096 envs on the GPU), after a warm-up update;
                also the rollout alone. The aim on an H100 is >= 1M env steps/s.
llm             on a randomly initialised model with Qwen2.5-0.5B's shapes, loaded with
                ``load_policy(path, lora=16)`` (bf16 on CUDA): sampler tokens/s for 8 prompts x 8 samples
                x 128 new tokens, and the time of one GRPO step (forward_backward + optim_step) on them
profile         only when named (``--only profile``): the sampler on the llm check's model, a decode step's
                wall time, and one profiled ``sample`` (GPU busy time and kernel launches per forward pass,
                the profiler's operator table)
==============  =========================================================================================

It prints one table (check, result, seconds) and writes it to ``--out`` as JSON; the exit status is
non-zero if any check failed. Each failing test or notebook cell is written, as it fails, to
``gpu_check_failures/`` beside ``--out`` (the cell's source, what it printed, the failure), and the end of each
is printed under the table: a run cut off by its time limit, or by the end of a GPU lease, still says what failed.
On a machine without an NVIDIA GPU it says so and exits 0, running nothing. ``ppo_throughput``,
``llm_throughput`` and ``sampler_profile`` also run on the CPU at tiny sizes (the unit tests call them so).

    python benchmarks/gpu_check.py                       # all four checks, table + gpu_check.json
    python benchmarks/gpu_check.py --only ppo llm        # just the throughput figures
    python benchmarks/gpu_check.py --only profile        # where the sampler's time goes
    python benchmarks/gpu_check.py --only notebooks --notebooks 06 08 10   # some notebooks, when time is short
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
FAILURES_ENV = "EDURL_FAILURES_DIR"  # book/nbcapture.py writes each failing test's report there as it happens
MAX_THREADS_ENV = "EDURL_MAX_THREADS"  # edurl.cpu_threads' cap
CHECKS = ("cuda-tests", "notebooks", "ppo", "llm", "profile")
DEFAULT_CHECKS = CHECKS[:4]  # the profile runs only when --only names it

#: Qwen2.5-0.5B's shapes (its config.json), for a randomly initialised stand-in: there is no hub here
QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1e6,
)


def missing_gpu() -> str | None:
    """Why this machine cannot run the checks (None when it can)."""
    reasons = []
    if not torch.cuda.is_available():
        reasons.append("torch.cuda.is_available() is False")
    if shutil.which("nvidia-smi") is None:
        reasons.append("nvidia-smi not found")
    return "; ".join(reasons) or None


def unusable_gpu() -> str | None:
    """A setup error: an NVIDIA GPU that ``nvidia-smi`` lists, which this torch cannot use (None otherwise). A run
    that hides the GPUs on purpose (``CUDA_VISIBLE_DEVICES`` empty or -1) is no error: it has no GPU to check."""
    if torch.cuda.is_available() or os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if listed.returncode != 0 or "GPU" not in listed.stdout:
        return None
    gpus = listed.stdout.strip().splitlines()[0]
    if torch.version.cuda is None:
        return (
            f"nvidia-smi lists a GPU ({gpus}), but this torch ({torch.__version__}) is a CPU build. Reinstall torch "
            "with CUDA: remove .venv and run `make setup` on this machine (it installs a CUDA build when nvidia-smi "
            "works), or `pip install --force-reinstall torch` in this environment."
        )
    return (
        f"nvidia-smi lists a GPU ({gpus}), and this torch ({torch.__version__}) was built with CUDA "
        f"{torch.version.cuda}, but torch.cuda.is_available() is False: check that the driver supports that CUDA "
        "version (nvidia-smi prints the driver's) and that CUDA_VISIBLE_DEVICES names a GPU that exists."
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------- pytest checks


def _merge_outcome(files: dict, name: str, outcome: str) -> None:
    """A file's outcome over its tests: failed if any failed, else the first one's (passed or skipped)."""
    if files.get(name) != "failed":
        files[name] = "failed" if outcome == "failed" else files.get(name, outcome)


def junit_counts(path: Path) -> dict:
    """Outcome counts of a pytest ``--junitxml`` report, and the outcome of each test file (or notebook)."""
    counts, files = Counter(), {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
        counts[outcome] += 1
        name = case.get("file") or case.get("classname") or "?"
        _merge_outcome(files, name, outcome)
    return {"passed": counts["passed"], "failed": counts["failed"], "skipped": counts["skipped"], "files": files}


def progress_counts(output: str) -> dict:
    """The shape of :func:`junit_counts`, read from ``pytest -v``'s per-test lines: for a run stopped before pytest
    wrote its report. Files are named as junit names them (``notebooks.05_ppo.ipynb``); ``finished`` counts each
    file's distinct tests seen."""
    outcomes = {}  # nodeid -> outcome; a test's teardown error after its pass makes it failed, never a second test
    # "[gw6] [ 74%] FAILED notebooks/08_rlhf::ipynb::Cell 9" under xdist, "notebooks/08_rlhf::ipynb::Cell 9 FAILED [ 74%]"
    # without; a notebook's cell ids hold a space
    for line in output.splitlines():
        if "short test summary info" in line:  # the summary repeats the failures
            break
        if m := re.match(r"(?:\[gw\d+\] \[\s*\d+%\] )?(PASSED|FAILED|ERROR|SKIPPED) (\S+::\S+(?: \d+)?)", line):
            outcome, nodeid = m.groups()
        elif m := re.match(r"(\S+::\S+(?: \d+)?) (PASSED|FAILED|ERROR|SKIPPED)\b", line):
            nodeid, outcome = m.groups()
        else:
            continue
        outcome = {"PASSED": "passed", "SKIPPED": "skipped"}.get(outcome, "failed")
        if outcomes.get(nodeid) != "failed":
            outcomes[nodeid] = outcome
    counts, files, finished = Counter(outcomes.values()), {}, Counter()
    for nodeid, outcome in outcomes.items():
        name = nodeid.replace("::ipynb::", ".ipynb::").split("::")[0].replace("/", ".")
        finished[name] += 1
        _merge_outcome(files, name, outcome)
    return {
        "passed": counts["passed"],
        "failed": counts["failed"],
        "skipped": counts["skipped"],
        "files": files,
        "finished": dict(finished),
    }


def run_pytest(args: list[str], timeout: float, env: dict | None = None, failures_dir: Path | None = None) -> dict:
    """``python -m pytest ARGS`` in a subprocess, with its exit status, outcome counts and output tail.

    Past ``timeout`` seconds the whole process group (xdist's workers too) is killed; the counts then come from the
    ``-v`` lines printed so far. With ``failures_dir``, each failing test's report is written there as it happens
    (book/nbcapture.py's ``record_failure``), and the paths are returned as ``failures``."""
    if failures_dir is not None:
        failures_dir = Path(failures_dir).resolve()  # pytest runs in REPO, this process may not
    with tempfile.TemporaryDirectory() as tmp:
        xml, log = Path(tmp) / "report.xml", Path(tmp) / "output.txt"
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
        extra = dict(env or {})
        if failures_dir is not None:
            shutil.rmtree(failures_dir, ignore_errors=True)
            extra[FAILURES_ENV] = str(failures_dir)
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd, cwd=REPO, env={**os.environ, **extra}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        output = log.read_text(errors="replace")
        counts = junit_counts(xml) if rc is not None and xml.exists() else progress_counts(output)
    if rc is None:
        output += f"\n[gpu_check: killed after {timeout:.0f} s]"
    failures = sorted(str(p) for p in failures_dir.glob("*.txt")) if failures_dir and failures_dir.exists() else []
    return {
        "returncode": rc,
        "timed_out": rc is None,
        **counts,
        "failures": failures,
        "command": " ".join(cmd[1:]),
        "output_tail": output[-3000:],
    }


def check_cuda_tests(timeout: float, failures_dir: Path | None = None) -> tuple[bool, str, dict]:
    r = run_pytest(["-m", "cuda", "tests"], timeout, failures_dir=failures_dir)
    ok = r["returncode"] == 0 and r["passed"] > 0
    result = f"{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped"
    if r["timed_out"]:
        result += f"; timed out after {timeout:.0f} s"
    return ok, result, r


def threads_per_worker(workers: int) -> int:
    from edurl.utils import usable_cores

    return max(1, usable_cores() // max(1, workers))


def code_cells(notebook: Path) -> int:
    return sum(cell["cell_type"] == "code" for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"])


def select_notebooks(names: list[str] | None) -> list[Path]:
    """The notebooks to run: all of them for None, else each name's notebook, by number ("06") or by path."""
    everything = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return everything
    chosen = []
    for name in names:
        path = Path(name)
        hits = (
            [path.resolve()]
            if path.suffix == ".ipynb" and path.exists()
            else [p for p in everything if p.name.startswith(f"{name}_")]
        )
        if not hits:
            raise ValueError(
                f"no notebook matches {name!r}: give a number or a path, one of "
                + ", ".join(p.name.split("_")[0] for p in everything)
            )
        chosen += [p for p in hits if p not in chosen]
    return chosen


def check_notebooks(
    timeout: float, workers: int, failures_dir: Path | None = None, notebooks: list[Path] | None = None
) -> tuple[bool, str, dict]:
    notebooks_run = notebooks or select_notebooks(None)
    # loadscope keeps each notebook's cells on one worker, as `make notebooks` does
    r = run_pytest(
        [
            "--nbval-lax",
            "--nbval-current-env",
            *(str(p) for p in notebooks_run),
            "-n",
            str(workers),
            "--dist",
            "loadscope",
        ],
        timeout,
        # as `make test` does: workers that each take every core's thread fight for them
        env={
            "EDURL_DEVICE": "cuda",
            MAX_THREADS_ENV: os.environ.get(MAX_THREADS_ENV, str(threads_per_worker(workers))),
        },
        failures_dir=failures_dir,
    )
    notebooks = r.pop("files")
    # junit names a notebook's cells by its path with dots: notebooks.01_rl_fundamentals.ipynb
    failed = sorted(name.removeprefix("notebooks.") for name, outcome in notebooks.items() if outcome == "failed")
    unfinished = []
    if r["timed_out"]:  # a notebook with fewer cells reported than it has was cut off
        for path in notebooks_run:
            seen, total = r.get("finished", {}).get(f"notebooks.{path.name}", 0), code_cells(path)
            if seen < total:
                unfinished.append(f"{path.name} ({seen} of {total} cells)")
                if notebooks.get(f"notebooks.{path.name}") != "failed":  # started or not
                    notebooks[f"notebooks.{path.name}"] = "unfinished"
    r["notebooks"] = notebooks
    passed = sum(outcome == "passed" for outcome in notebooks.values())
    ok = r["returncode"] == 0 and notebooks and not failed
    result = f"{passed}/{len(notebooks)} notebooks passed ({r['passed']} cells)"
    if failed:
        result += "; failed: " + ", ".join(failed)
    if r["timed_out"]:
        result += f"; timed out after {timeout:.0f} s" + (
            ", unfinished: " + ", ".join(unfinished) if unfinished else ""
        )
    return bool(ok), result, r


# ---------------------------------------------------------------------------------------------- throughput


def ppo_throughput(
    device: str = "cuda",
    num_envs: int = 4096,
    num_steps: int = 32,
    updates: int = 10,
    rollouts: int = 10,
    num_seeds: int = 1,
) -> dict:
    """PPO env steps per second with ``TorchCartPole`` on ``device``, and the rollout's alone.

    With ``num_seeds`` > 1, that many seeds train in one process (``PPOConfig.num_seeds``), each on
    ``num_envs`` envs, and the rate counts the env steps of all of them.

    PPO: ``train_ppo`` runs 1 + ``updates`` updates of ``num_envs * num_steps`` env steps (the course's
    PPOConfig otherwise: 20 epochs over each batch); the rate is taken from the logged wall clock between
    the end of the first update (the warm-up: allocations, kernel selection) and the end of the last.
    Rollout: ``collect_rollout`` of a fresh policy, ``rollouts`` times after one warm-up rollout.
    """
    from edurl import load_metrics
    from edurl.envs import TorchCartPole
    from edurl.rl import CategoricalPolicy, PPOConfig, collect_rollout, train_ppo

    dev = torch.device(device)
    batch = num_envs * num_steps
    with tempfile.TemporaryDirectory() as log_dir:
        config = PPOConfig(
            env_backend="torch",
            num_envs=num_envs,
            num_steps=num_steps,
            total_steps=batch * (updates + 1),
            stop_when_solved=False,
            device=device,
            progress=False,
            log_dir=log_dir,
            seed=0,
            num_seeds=num_seeds,
        )
        train_ppo(config)
        m = load_metrics(log_dir if num_seeds == 1 else f"{log_dir}/seed0")  # every seed steps in every update
    steps, seconds = m["step"].to_numpy(), m["time/total"].to_numpy()
    ppo_rate = num_seeds * (steps[-1] - steps[0]) / (seconds[-1] - seconds[0])

    env = TorchCartPole(num_envs, device=dev, check_actions=False)  # as the trainers run it: no host sync
    obs, _ = env.reset(seed=0)
    policy = CategoricalPolicy(env.obs_dim, env.num_actions).to(dev)
    ro, obs, counter = collect_rollout(env, policy, obs, num_steps, dev)  # warm-up
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(rollouts):
        ro, obs, counter = collect_rollout(env, policy, obs, num_steps, dev, counter)
    _sync(dev)
    rollout_rate = rollouts * batch / (time.perf_counter() - t0)
    return {
        "device": str(dev),
        "num_envs": num_envs,
        "num_seeds": num_seeds,
        "num_steps": num_steps,
        "timed_updates": updates,
        "ppo_env_steps_per_s": float(ppo_rate),
        "rollout_env_steps_per_s": float(rollout_rate),
    }


def check_ppo(num_envs: int, num_seeds: int = 8) -> tuple[bool, str, dict]:
    one = ppo_throughput("cuda", num_envs=num_envs)
    many = ppo_throughput("cuda", num_envs=num_envs, num_seeds=num_seeds)
    for r in (one, many):
        r["aim_env_steps_per_s"], r["meets_aim"] = 1e6, r["ppo_env_steps_per_s"] >= 1e6
    return (
        True,
        (
            f"{one['ppo_env_steps_per_s'] / 1e6:.2f}M env steps/s (rollout alone "
            f"{one['rollout_env_steps_per_s'] / 1e6:.2f}M/s), {num_envs} envs; {num_seeds} seeds in one process: "
            f"{many['ppo_env_steps_per_s'] / 1e6:.2f}M env steps/s; aim >= 1M"
        ),
        {"one_seed": one, f"{num_seeds}_seeds": many},
    )


def qwen_shaped_policy(
    dev: torch.device, model_shapes: dict | None, num_prompts: int, prompt_len: int, lora_rank: int, seed: int
):
    """A randomly initialised Qwen2 model with ``model_shapes`` (Qwen2.5-0.5B's by default), saved to a temp folder and
    loaded back with ``load_policy(path, lora=lora_rank)``, the path a real checkpoint takes (bf16 on CUDA, float32 on
    the CPU); and ``num_prompts`` random prompts of ``prompt_len`` token ids past the tokenizer's own (never its pad or
    stop tokens). Returns (model, tokenizer, prompts, setup seconds)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from edurl.llm.policy import load_policy
    from edurl.llm.tokenizer import build_bpe_tokenizer

    shapes = {**QWEN25_05B, **(model_shapes or {})}
    # for its pad id and chat template; the token ids here are random. A byte-level BPE, as Qwen's is: the course's
    # character tokenizer saved beside a Qwen2 config loads as Qwen2's tokenizer, loses its spaces, and is refused
    tokenizer = build_bpe_tokenizer(["What is 12+34? The answer is \\boxed{46}."] * 20, split="qwen2")
    config = Qwen2Config(**shapes, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(seed)
        with torch.device(dev):  # initialise on the GPU: half a billion weights are slow to draw on a CPU
            base = Qwen2ForCausalLM(config)
        if dev.type == "cuda":
            base.to(torch.bfloat16)
        base.save_pretrained(path)
        tokenizer.save_pretrained(path)
        del base
        model, tokenizer = load_policy(path, lora=lora_rank, device=dev)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    prompts = torch.randint(len(tokenizer), shapes["vocab_size"], (num_prompts, prompt_len), generator=gen).tolist()
    return model, tokenizer, prompts, time.perf_counter() - t0


def llm_throughput(
    device: str = "cuda",
    model_shapes: dict | None = None,
    num_prompts: int = 8,
    num_samples: int = 8,
    prompt_len: int = 64,
    max_tokens: int = 128,
    lora_rank: int = 16,
    seed: int = 0,
) -> dict:
    """Sampler tokens/s and one LoRA GRPO step's seconds on a random model with ``model_shapes`` (Qwen2 config).

    The model is saved to a temp folder and loaded back with ``load_policy(path, lora=lora_rank)``, the path
    a real checkpoint takes (bf16 on CUDA, float32 on the CPU). Prompts are random token ids, sampled with no
    stop sequence, so every completion has ``max_tokens`` tokens. The GRPO step is one ``forward_backward``
    (importance-sampling loss, token-mean, group-centred random rewards) and one ``optim_step`` over all the
    completions; it runs twice and the second, warm step is the one reported.
    """
    from edurl.llm.clients import AdamParams, TrainingClient
    from edurl.llm.datum import build_datum
    from edurl.llm.sampling import SamplingParams, sample

    dev = torch.device(device)
    model, tokenizer, prompts, setup_seconds = qwen_shaped_policy(
        dev, model_shapes, num_prompts, prompt_len, lora_rank, seed
    )
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)
    pad = tokenizer.pad_token_id
    sample(model, prompts[:1], 1, SamplingParams(max_tokens=4, seed=seed), pad_token_id=pad)  # warm-up
    _sync(dev)
    t0 = time.perf_counter()
    completions = sample(model, prompts, num_samples, params, pad_token_id=pad, eos_token_id=[])  # never stops early
    sample_seconds = time.perf_counter() - t0
    num_tokens = sum(len(c.tokens) for c in completions)

    rewards = torch.rand(num_prompts, num_samples, generator=gen, device="cpu")  # (P, G)
    advantages = rewards - rewards.mean(1, keepdim=True)  # group-centred, as GRPO's
    datums = [
        build_datum(prompts[c.prompt_index], c.tokens, c.logprobs, float(advantages.flatten()[i]))
        for i, c in enumerate(completions)
    ]
    trainer = TrainingClient(model, tokenizer)
    step_seconds = []
    for _ in range(2):
        _sync(dev)
        t0 = time.perf_counter()
        trainer.forward_backward(datums, "importance_sampling", aggregation="token_mean").result()
        trainer.optim_step(AdamParams(learning_rate=1e-5)).result()
        _sync(dev)
        step_seconds.append(time.perf_counter() - t0)
    return {
        "device": str(dev),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "lora_rank": lora_rank,
        "prompts": num_prompts,
        "samples_per_prompt": num_samples,
        "prompt_tokens": prompt_len,
        "max_tokens": max_tokens,
        "sampled_tokens": num_tokens,
        "sample_seconds": sample_seconds,
        "sampler_tokens_per_s": num_tokens / sample_seconds,
        "grpo_step_seconds": step_seconds[-1],
        "first_grpo_step_seconds": step_seconds[0],
        "setup_seconds": setup_seconds,
    }


def check_llm() -> tuple[bool, str, dict]:
    r = llm_throughput("cuda")
    return (
        True,
        (
            f"sampler {r['sampler_tokens_per_s']:,.0f} tok/s; LoRA-{r['lora_rank']} {r['dtype']} GRPO step "
            f"{r['grpo_step_seconds']:.2f} s ({r['prompts']}x{r['samples_per_prompt']} seqs)"
        ),
        r,
    )


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def sampler_profile(
    device: str = "cuda",
    model_shapes: dict | None = None,
    num_prompts: int = 8,
    num_samples: int = 8,
    prompt_len: int = 64,
    max_tokens: int = 32,
    lora_rank: int = 16,
    seed: int = 0,
    rows: int = 15,
) -> dict:
    """Where the sampler's time goes on ``llm_throughput``'s model and prompts: a decode step's wall time (an
    unprofiled ``sample`` of ``max_tokens`` tokens, less a prefill-only one, over the ``max_tokens - 1`` decode
    steps), then one profiled ``sample``: the device's busy time and the kernel launches per forward pass, and the
    profiler's table of operators by their own CPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from edurl.llm.sampling import SamplingParams, sample

    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2 (a decode step is the difference of two samples), got {max_tokens}")
    dev = torch.device(device)
    model, tokenizer, prompts, _ = qwen_shaped_policy(dev, model_shapes, num_prompts, prompt_len, lora_rank, seed)
    pad = tokenizer.pad_token_id

    def run(tokens: int) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        sample(
            model, prompts, num_samples, SamplingParams(max_tokens=tokens, seed=seed), pad_token_id=pad, eos_token_id=[]
        )
        _sync(dev)
        return time.perf_counter() - t0

    run(2)  # warm-up
    whole, prefill = run(max_tokens), run(1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run(max_tokens)
    events = prof.key_averages()
    forwards = max_tokens  # the prefill and max_tokens - 1 decode steps (no stop: every row runs to the end)
    # a kernel's time is listed twice, under its own (device) row and under the operator that launched it: count it once
    device_us = sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU)
    return {
        "device": str(dev),
        "sequences": num_prompts * num_samples,
        "decode_step_ms": (whole - prefill) / (max_tokens - 1) * 1e3,
        "prefill_ms": prefill * 1e3,
        "device_busy_ms_per_forward": device_us / 1e3 / forwards,
        "cpu_ms_per_forward": sum(e.self_cpu_time_total for e in events) / 1e3 / forwards,
        "kernel_launches_per_forward": sum(e.count for e in events if e.key in LAUNCHES) / forwards,
        "table": events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48),
    }


def check_sampler_profile() -> tuple[bool, str, dict]:
    r = sampler_profile("cuda")
    print(r["table"], flush=True)
    return (
        True,
        (
            f"decode step {r['decode_step_ms']:.1f} ms for {r['sequences']} seqs; per forward: GPU busy "
            f"{r['device_busy_ms_per_forward']:.1f} ms (profiled), {r['kernel_launches_per_forward']:,.0f} kernel launches"
        ),
        r,
    )


# ---------------------------------------------------------------------------------------------- the table


def run_check(name: str, fn) -> dict:
    """Run one check; an exception makes it a failed row, never the end of the run."""
    t0 = time.perf_counter()
    try:
        ok, result, details = fn()
    except Exception as err:  # noqa: BLE001 -- isolation is the point
        ok, result, details = False, f"error: {type(err).__name__}: {err}", {"traceback": traceback.format_exc()}
    row = {
        "check": name,
        "ok": bool(ok),
        "result": result,
        "seconds": round(time.perf_counter() - t0, 1),
        "details": details,
    }
    print(f"  {name}: {'ok' if ok else 'FAILED'} -- {result} ({row['seconds']} s)", flush=True)
    return row


def format_table(rows: list[dict]) -> str:
    width = max([len("check")] + [len(r["check"]) for r in rows])
    lines = [f"{'check':{width}s}  {'':6s}  {'seconds':>7s}  result"]
    for r in rows:
        lines.append(f"{r['check']:{width}s}  {'ok' if r['ok'] else 'FAILED':6s}  {r['seconds']:7.1f}  {r['result']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from edurl.utils import usable_cores

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check.json", help="where to write the table as JSON")
    ap.add_argument("--only", nargs="+", choices=CHECKS, default=list(DEFAULT_CHECKS), help="run only these checks")
    ap.add_argument(
        "--workers", type=int, default=min(10, usable_cores()), help="pytest-xdist workers for the notebooks"
    )
    ap.add_argument("--num-envs", type=int, default=4096, help="TorchCartPole envs for the PPO check")
    ap.add_argument("--tests-timeout", type=float, default=150, help="seconds allowed for pytest -m cuda")
    # on an H200 (2026-11-26) notebooks 01-09 took under 380 s with 10 workers, and 10 alone more than 300 s: the tiny
    # models are launch-bound on a GPU, so allow far more than that
    ap.add_argument("--notebooks-timeout", type=float, default=900, help="seconds allowed for the notebooks")
    ap.add_argument(
        "--notebooks",
        nargs="+",
        metavar="NN",
        help="run only these notebooks, by number or path (e.g. --notebooks 06 08): a GPU lease may not hold all ten",
    )
    args = ap.parse_args(argv)
    try:
        notebooks = select_notebooks(args.notebooks)
    except ValueError as err:
        ap.error(str(err))

    broken = unusable_gpu()
    if broken:
        print(f"gpu-check: {broken} Nothing run.", file=sys.stderr)
        return 1
    why = missing_gpu()
    if why:
        print(f"gpu-check: no NVIDIA GPU found ({why}); nothing run.")
        return 0
    failures = Path(args.out).with_name(Path(args.out).stem + "_failures")  # each failing test's report, as it happens
    checks = {
        "cuda-tests": lambda: check_cuda_tests(args.tests_timeout, failures / "cuda-tests"),
        "notebooks": lambda: check_notebooks(args.notebooks_timeout, args.workers, failures / "notebooks", notebooks),
        "ppo": lambda: check_ppo(args.num_envs),
        "llm": check_llm,
        "profile": check_sampler_profile,
    }
    gpu = torch.cuda.get_device_name(0)
    print(f"gpu-check on {gpu} (torch {torch.__version__}, CUDA {torch.version.cuda})", flush=True)
    rows = [run_check(name, checks[name]) for name in CHECKS if name in args.only]
    print("\n" + format_table(rows))
    for row in rows:
        for path in row["details"].get("failures", []):
            text = Path(path).read_text(encoding="utf-8")
            print(
                f"\n{row['check']}: {Path(path).name} (the whole report: {path})\n" + "\n".join(text.splitlines()[-25:])
            )
    report = {
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "checks": rows,
        "ok": all(r["ok"] for r in rows),
    }
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
