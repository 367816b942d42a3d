"""The benchmark scripts that need no peer library still run: a few steps of each, as a subprocess.

Benchmarks are run by hand, so a change to the library's internals can break one silently: in stop 33
``_stack_update`` lost its ``alive`` argument and ``benchmarks/ppo_update_profile.py`` crashed until the next
session ran it.
"""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _benchmark(name: str):
    """Import benchmarks/NAME.py as a module, with benchmarks/ on sys.path while it imports its siblings."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def _script(*args: str, timeout: int = 120) -> str:
    """Run ``python *args`` from the repository root; its stdout, after checking that it exited 0."""
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_ppo_update_profile_runs():
    out = _script(
        "benchmarks/ppo_update_profile.py",
        *("--steps", "10", "--warmup", "1", "--seeds", "1,2", "--torch-profile", "--head-products"),
        timeout=300,
    )
    assert "seed stack, 2 seed(s)" in out and "optimizer.step" in out
    assert "torch profile, 2 seed(s)" in out and "policy head weight gradient, 2 seed(s)" in out


def test_snapshot_cost_runs_and_the_snapshot_holds_only_the_adapter():
    out = _script("benchmarks/snapshot_cost.py", "--layers", "1", "--repeats", "1", "--rank", "2", timeout=300)
    rows = {
        line.split("|")[1].strip(): line.split("|")[3].strip() for line in out.splitlines() if line.startswith("| ")
    }
    whole, edurl = float(rows["whole copy"]), float(rows["edurl (adapter copied, base shared)"])
    assert whole > 500 and edurl < 1, out  # the base is about 520 MB of float32 here; the adapter a few kB
    assert "edurl / whole copy" in out


def test_llm_margins_summary_reads_two_study_runs_side_by_side(tmp_path):
    import json

    rows = {
        "a.jsonl": [
            {"experiment": "off_policy", "variant": "threads=1", "seed": s, "kl_gap": v}
            for s, v in enumerate((0.90, 0.95, 0.93))
        ],
        "b.jsonl": [{"experiment": "off_policy", "variant": "threads=1", "seed": 0, "kl_gap": 0.5}],
    }
    for name, runs in rows.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in runs))
    out = _script("benchmarks/_llm_margins.py", "--summary", f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}")
    line = next(x for x in out.splitlines() if x.strip().startswith("kl_gap"))
    assert "0.93 (0.9 to 0.95) [3]" in line and "0.5 (0.5 to 0.5) [1]" in line
    assert "seed" not in [x.split()[0] for x in out.splitlines() if x.startswith("  ")]


def test_assert_margins_counts_a_variant_that_repeats_another_run_once(capsys):
    """A floating-point variant that changes nothing must not double an assert's runs.

    Until 2026-11-29 the study's second variant (MKL_ENABLE_INSTRUCTIONS=AVX2 alone) repeated every run of
    the AMD development machine to the bit, and the chapters counted 20 runs where there were 10 draws. An
    estimate from fixed data moves only in its last digits on another path: the same draw, too.
    """
    import math

    import pandas as pd

    nan = math.nan

    def run(experiment, variant, seed, **stats):
        return {"experiment": experiment, "variant": variant, "seed": seed, "seconds": 1.0 + seed, **stats}

    runs = pd.DataFrame(
        [
            run("ppo", "default", 0, steps=78080.0, kl=nan),
            run("ppo", "default", 1, steps=nan, kl=nan),
            run("gae_study", "default", 0, steps=nan, kl=0.25),
            # the same statistics (NaN where the default's are NaN), another time: repeats
            run("ppo", "generic", 0, steps=78080.0, kl=nan) | {"seconds": 9.1},
            run("ppo", "generic", 1, steps=nan, kl=nan),
            # an estimate off by 4e-4 (rounding): the same draw; off by 2 %: a new one
            run("gae_study", "generic", 0, steps=nan, kl=0.2501),
            run("gae_study", "threads=2", 0, steps=nan, kl=0.255),
            # a training run within 0.1 % of another (78,081 env steps against 78,080): a new draw
            run("ppo", "threads=2", 0, steps=78081.0, kl=nan),
            # solved where the default run did not, and a seed the default variant did not run: new draws
            run("ppo", "threads=2", 1, steps=90000.0, kl=nan),
            run("ppo", "generic", 2, steps=71168.0, kl=nan),
            # no default run (the LLM studies label theirs by thread count): the second of two equal runs is a
            # repeat, whatever its timings
            run("grpo", "threads=1", 0, kl=0.5, rl_seconds=9.0),
            run("grpo", "threads=2", 0, kl=0.5, rl_seconds=7.0),
        ]
    )
    kept = _benchmark("assert_margins").distinct_runs(runs)
    assert list(zip(kept["variant"], kept["experiment"], kept["seed"])) == [
        ("default", "ppo", 0),
        ("default", "ppo", 1),
        ("default", "gae_study", 0),
        ("threads=2", "gae_study", 0),
        ("threads=2", "ppo", 0),
        ("threads=2", "ppo", 1),
        ("generic", "ppo", 2),
        ("threads=1", "grpo", 0),
    ]
    out = capsys.readouterr().out
    assert "generic: 3 of 4" in out and "threads=2: 1 of 4" in out


def test_staleness_sweep_reports_and_plots_recorded_runs(tmp_path):
    import json

    def row(seed, shift):
        r = {"experiment": "staleness_sweep", "variant": "threads=1", "seed": seed, "start_pass": 0.3}
        r.update({"k0_pass": 0.5, "k0_kl_v2": 1e-9, "k0_clip": 0.0})
        for k in (1, 2, 4, 8):
            for i, loss in enumerate(("importance_sampling", "ppo", "cispo")):
                r.update({f"k{k}_{loss}_pass": 0.5 - 0.01 * k * (i + shift), f"k{k}_{loss}_kl_v2": 0.01 * k})
                r[f"k{k}_{loss}_clip"] = 0.001 * k if loss == "ppo" else 0.0
        if seed == 1:
            r["k8_ppo_kl_v2"] = 0.03  # below k = 4's 0.04
        return r

    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(json.dumps(row(s, s)) + "\n" for s in (0, 1)))
    out = _script("benchmarks/staleness_sweep.py", "--load", str(path), "--plot", str(tmp_path / "s.png"))
    # k = 8, ppo (i = 1): seed 0 is 8 points below on-policy, seed 1 (shift 1) 16: median -12
    assert " 8  ppo                  -12.0 (-16.0 to -8.0)" in out, out
    # importance_sampling minus the mean of the other two at k = 8: seed 0: 0 - (-8 - 16) / 2 = +12, seed 1: +12
    assert "k = 8: +12.0 (+12.0 to +12.0); below on 0 of 2 seeds" in out, out
    assert "rises with every step of k, importance_sampling: on 2 of 2 seeds" in out, out
    assert "rises with every step of k, ppo: on 1 of 2 seeds" in out, out  # seed 1's ppo kl dips at k = 8
    assert (tmp_path / "s.png").stat().st_size > 0


def _multiturn_report(tmp_path, *rows: dict) -> str:
    """What ``multiturn_games.py --load`` prints for these rows."""
    import json

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return _script("benchmarks/multiturn_games.py", "--load", str(path))


def test_multiturn_games_report_keeps_recipes_apart(tmp_path):

    base = {"game": "calculator", "seed": 0, "sft_steps": 1000, "rl_steps": 60, "threads": 1, "sft_seconds": 1.0}
    base.update({"rl_seconds": 2.0, "start_correct": 0.5, "start_used_tool": 1.0, "start_correct_no_tool": 0.0})
    base.update({"final_correct": 0.9, "final_used_tool": 1.0, "final_correct_no_tool": 0.0})
    old = dict(base)  # a row written before tool_fraction, the temperature and the mixed share were recorded
    new = dict(base, seed=1, tool_fraction=0.75, rl_temperature=1.0, mixed_groups_second_half=0.08, final_correct=0.7)
    slow = dict(new, seed=2, sft_learning_rate=1e-3, start_correct_sampled=0.785, final_correct_sampled=0.8)
    out = _multiturn_report(tmp_path, old, new, slow)
    assert "tool_fraction 0.5, lr 0.003, RL 60 steps at T = 1.0, no prefix cache: 1 seeds" in out, out
    assert "tool_fraction 0.75, lr 0.003, RL" in out and "tool_fraction 0.75, lr 0.001, RL" in out, out
    assert "met on 1 of 1 seeds" in out and out.count("met on 0 of 1 seeds") == 2, out
    assert "RL groups with mixed rewards   8.0 %" in out, out
    assert "warm start with the tool, T=1    78.5 %" in out and out.count("with the tool, T=1") == 2, out


def test_multiturn_games_keeps_kl_recipes_apart_and_checks_rl_set(tmp_path):

    row = {"game": "guess_number", "seed": 0, "sft_steps": 1500, "rl_steps": 150, "threads": 1, "sft_seconds": 1.0}
    row.update({"rl_seconds": 2.0, "start_win": 0.7, "start_win_sampled": 0.48, "final_win": 0.6})
    old = dict(row, final_win_sampled=0.52)  # written before kl_coef and relative were recorded
    new = dict(row, seed=1, kl_coef=0.1, relative=True, final_win_sampled=0.8, prefix_cache=True)
    new.update(start_scratchpad_ok=0.99, final_scratchpad_ok=0.97)
    slow = dict(new, seed=2, scratchpad_bonus=0.1, rl_seconds=301.0)  # the target's gain, but over 5 minutes
    out = _multiturn_report(tmp_path, old, new, slow)
    assert "RL 150 steps at T = 1.0, no prefix cache: 1 seeds" in out, out
    assert "kl_coef 0.1, relative shaping: 1 seeds" in out, out
    assert "kl_coef 0.1, relative shaping, scratchpad_bonus 0.1: 1 seeds" in out, out
    assert out.count("+25 points)  met on 0 of 1 seeds") == 1 and out.count("+25 points)  met on 1 of 1 seeds") == 2
    assert out.count("within 5 minutes of RL                 met on 1 of 1 seeds") == 1, out
    assert "scratchpad right, final (sampled)  97.0 %" in out, out
    for flag, bad in [
        ("--rl-set", "foo=1"),
        ("--rl-set", "kl_coef=x"),
        ("--rl-set", "kl_coef"),
        ("--sft-set", "kl_coef=0.1"),  # a field of the RL config, not of the warm start's
        ("--sft-set", "learning_rate=fast"),
        ("--rl-set", "seed=1"),  # set by --seeds: a TypeError deep in the run without the check
        ("--sft-set", 'game="calculator"'),  # set by --games
    ]:
        proc = subprocess.run(
            [sys.executable, "benchmarks/multiturn_games.py", flag, bad],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and flag in proc.stderr and bad.split("=")[0] in proc.stderr, proc.stderr


def test_grpo_variants_report_counts_gains_per_variant_and_step(tmp_path):
    import json

    def row(variant, seed, start, after, **extra):  # after: {updates done: held-out pass@1}
        curve = [[0, start]] + [[s, p] for s, p in after.items()]
        return {"variant": variant, "seed": seed, "start": start, "curve": curve, **extra}

    rows = [
        row("default", 0, 0.30, {50: 0.40}),  # the first 50 steps of the next run: counted once, as the longer
        row("default", 0, 0.30, {50: 0.40, 150: 0.50}, sft_steps=570, sft_target_met=True),  # +10, +20
        row("default", 1, 0.40, {50: 0.70, 150: 0.75}, sft_steps=1340, sft_target_met=False),  # +30, +35
        row("default", 2, 0.50, {50: 0.55}),  # a run of 50 steps: absent from the 150 column
        row("lr1e-3", 0, 0.30, {50: 0.10, 150: 0.05}),  # -20, -25
    ]
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _script("benchmarks/grpo_variants.py", "--report", str(path), "--plot", str(tmp_path / "v.png"))
    default = next(x for x in out.splitlines() if x.startswith("default"))
    # after 50 steps: gains +10, +30, +5 -> median +10.0, 1 of 3 at +15 or more; after 150: +20, +35
    assert "+10.0 (+5.0 to +30.0) 1/3" in default and "+27.5 (+20.0 to +35.0) 2/2" in default, out
    lr = next(x for x in out.splitlines() if x.startswith("lr1e-3"))
    assert "-20.0 (-20.0 to -20.0) 0/1" in lr and "-25.0 (-25.0 to -25.0) 0/1" in lr, out
    assert "std" not in [x.split()[0] for x in out.splitlines() if x.strip()]  # no runs, no row
    seeds = {x.split()[0]: x.split() for x in out.splitlines() if x.strip() and x.split()[0] in "012"}
    assert seeds["0"][2] == "570" and seeds["1"][2:4] == ["1340", "(missed)"] and seeds["2"][2] == "?", out
    assert (tmp_path / "v.png").stat().st_size > 0
    path.write_text(path.read_text(encoding="utf-8") + json.dumps(row("default", 3, 0.3, {50: 0.4}, threads=2)) + "\n")
    mixed = subprocess.run(
        [sys.executable, "benchmarks/grpo_variants.py", "--report", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert mixed.returncode == 1 and "report each thread count's files on their own" in mixed.stderr, mixed.stderr
    proc = subprocess.run(
        [sys.executable, "benchmarks/grpo_variants.py", "--variants", "default,fast", "--out", str(tmp_path / "x")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown variant(s) fast" in proc.stderr, proc.stderr


def test_grpo_variants_report_compares_gains_within_a_minute_of_training(tmp_path):
    import json

    def row(variant, seed, start, after, seconds, **extra):  # after: {updates: pass@1}; seconds: training s at each
        curve = [[0, start]] + [[s, p] for s, p in after.items()]
        return {
            "variant": variant,
            "seed": seed,
            "start": start,
            "curve": curve,
            "curve_seconds": [0.0, *seconds],
        } | extra

    rows = [
        row("default", 0, 0.30, {50: 0.45, 150: 0.70}, [30.0, 70.0]),  # at 30 s: +15 (the +40 at 70 s is too late)
        row("default", 1, 0.40, {50: 0.75, 150: 0.80}, [20.0, 50.0], frac_mixed=0.5),  # at 50 s: +40
        row("g8", 0, 0.30, {50: 0.65}, [61.0]),  # nothing but the start within 60 s: +0
        row("std", 0, 0.30, {50: 0.40}, [10.0]),
    ]
    rows[-1].pop("curve_seconds")  # a run recorded without seconds: in the step table only
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _script("benchmarks/grpo_variants.py", "--report", str(path)).splitlines()
    block = out[next(i for i, x in enumerate(out) if x.startswith("per second")) + 1 :]
    block = block[: block.index("")]
    assert (
        block[0].split()
        == "default +27.5 (+15.0 to +40.0) 1/2 60 s (50 to 70) for 150 steps mixed 50% (50% to 50%)".split()
    )
    assert block[1].split() == "g8 +0.0 (+0.0 to +0.0) 0/1 61 s (61 to 61) for 50 steps".split(), out
    assert len(block) == 2, out


def test_learning_curve_counts_training_seconds_at_each_evaluation():
    import math
    from types import SimpleNamespace

    import pandas as pd

    variants = _benchmark("grpo_variants")
    gains_within, learning_curve = variants.gains_within, variants.learning_curve
    metrics = pd.DataFrame(
        {
            "step": [0, 1, 2, 3],
            "time/sample": [1.0, 1.0, 1.0, 1.0],
            "time/train": [2.0, 2.0, 2.0, 2.0],
            "time/step": [3.5, 3.5, 3.5, 3.5],  # the two halves and the sampler's snapshot, 0.5 s
            "test/pass_at_1": [math.nan, 0.5, math.nan, 0.7],  # evaluated after steps 1 and 3 (0-based)
        }
    )
    result = SimpleNamespace(metrics=metrics, start=SimpleNamespace(pass_at_1=0.3))
    curve = learning_curve(result)
    assert curve == {"curve": [[0, 0.3], [2, 0.5], [4, 0.7]], "curve_seconds": [0.0, 7.0, 14.0]}
    run = {"start": 0.3, **curve}
    assert [round(g, 6) for g in gains_within([run], 13.9)] == [0.2]  # grpo_vs_sft.py --check's measure
    assert [round(g, 6) for g in gains_within([run], 14.0)] == [0.4]
    assert gains_within([run], 6.5) == [0.0]  # only the start lies within 6.5 s


def test_async_budget_reports_a_failing_side_half_instead_of_waiting_for_ever():
    import threading

    beside = _benchmark("async_budget").beside

    def broken():
        raise ValueError("the sampler broke")

    outcome = []

    def call():
        try:
            beside(lambda: None, broken, reps=2, threads=1)
        except RuntimeError as e:
            outcome.append(e)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=60)
    assert not caller.is_alive(), "beside() still waits for a half that failed"
    assert outcome and isinstance(outcome[0].__cause__, ValueError), outcome
    assert beside(lambda: None, lambda: None, reps=3, threads=1) >= 0.0


def test_async_budget_beside_process_reports_a_second_process_that_died(monkeypatch, capfd):
    import pytest

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # the spawned process imports async_budget by name
    beside_process = _benchmark("async_budget").beside_process
    with pytest.raises(RuntimeError, match="'nonsense' half exited with status 1 before it was ready"):
        beside_process(lambda: None, "nonsense", at=0, cores=1, reps=1, threads=1, start_timeout=120)
    assert "which must be one of ('sample', 'train'), got 'nonsense'" in capfd.readouterr().err


def test_grpo_vs_sft_runs_the_grpo_arm_alone(tmp_path):
    """``--grpo-only``: the learning target's table over seeds without the SFT baseline (and its plot)."""
    out = _script("benchmarks/grpo_vs_sft.py", "--smoke", "--grpo-only", "--out", str(tmp_path), timeout=300)
    assert "continued SFT" not in out and "GRPO gain" in out and "gain by 60 s" in out
    assert (tmp_path / "grpo_vs_sft.png").exists()


@pytest.mark.parametrize(
    "script", sorted(p.name for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_")), ids=str
)
def test_every_benchmark_script_shows_its_help(script):
    # the README and the chapters send readers to these scripts' flags; grpo_vs_sft.py's --help once crashed on a
    # bare "%" in a help string
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--help"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_seed_lists_and_counts_are_checked_by_argparse():
    """A typo reached int() or pandas inside the run (--seeds a, --seeds 0,1,...,12 as Chapter 7 once wrote it,
    --seeds 0 for a count), sometimes after a saved study had been emptied."""
    import argparse

    args = _benchmark("_args")
    assert args.seed_list("0,1,2") == [0, 1, 2] and args.seed_list("7") == [7]
    for bad in ("", "a", "0,1,...,12", "0, -1", "1,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            args.seed_list(bad)
    assert args.positive_int("3") == 3
    for bad in ("0", "-2", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            args.positive_int(bad)


def test_a_seed_list_where_a_count_is_wanted_says_which_count_to_write():
    """cartpole.py --seeds 0,1,2 said only "'0,1,2' is not an int": most scripts take a list there."""
    import argparse

    args = _benchmark("_args")
    assert args.seed_count("5") == 5
    with pytest.raises(argparse.ArgumentTypeError, match="how many seeds to run.*write --seeds 3"):
        args.seed_count("0,1,2")
    for bad in ("0", "x", "0,a"):
        with pytest.raises(argparse.ArgumentTypeError):
            args.seed_count(bad)


def test_serve_grpo_takes_seeds_with_spaces_or_commas():
    """serve_grpo.py was the one script whose --seeds took 0 1 2 and refused 0,1,2, the form every other list takes."""
    import argparse

    args = _benchmark("_args")
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=args.seed_list, nargs="+", default=[[0, 1]])
    for argv, seeds in ((["--seeds", "0", "1", "2"], [0, 1, 2]), (["--seeds", "0,1,2"], [0, 1, 2]), ([], [0, 1])):
        assert args.seed_lists(parser, parser.parse_args(argv).seeds) == seeds
    with pytest.raises(SystemExit):
        args.seed_lists(parser, parser.parse_args(["--seeds", "0,1", "1"]).seeds)
    source = (REPO / "benchmarks" / "serve_grpo.py").read_text(encoding="utf-8")
    assert 'type=seed_list, nargs="+"' in source and "seed_lists(parser, args.seeds)" in source


@pytest.mark.parametrize(
    "argv, message",
    [
        (["benchmarks/grpo_vs_sft.py", "--smoke", "--check"], "--smoke runs 3 steps of seed 0"),
        (["benchmarks/grpo_vs_sft.py", "--seeds", "a"], "is not a list of seeds"),
        (["benchmarks/assert_margins.py", "--seeds", "0"], "must be at least 1"),
        (["benchmarks/assert_margins.py", "--notebooks", "11"], "no asserts studied for notebooks ['11']"),
        (["benchmarks/assert_margins.py", "--load", "no_such_file.json"], "--load: no such file"),
        (["benchmarks/cartpole.py", "--seeds", "0,1,2"], "how many seeds to run"),
        (["benchmarks/multiturn_games.py", "--games", "guess_number,calc"], "unknown games ['calc']"),
        (["benchmarks/multiturn_games.py", "--rl-steps", "0"], "must be at least 1"),
        (["benchmarks/ppo_update_profile.py", "--steps", "0"], "must be at least 1"),
        (["benchmarks/short_row_attention.py", "--repeats", "0"], "must be at least 1"),
    ],
)
def test_a_bad_benchmark_flag_is_one_line_before_any_work(argv, message, tmp_path):
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-1500:]


def test_a_peer_run_tests_the_solve_condition_only_when_an_episode_ends(monkeypatch):
    common = _benchmark("_common")
    calls = []
    monkeypatch.setattr(common, "solved_at", lambda returns: calls.append(len(returns)))  # None: not solved yet
    log = common.SolveLog()
    assert log.record([{}, {}], 2)  # no episode ended: nothing to test
    assert log.record([{}, {"episode": {"r": 12.0}}, {"episode": {"r": 30.0}}], 5)
    assert calls == [2]  # one test after the two episodes, none on the step before
    assert (log.returns, log.steps) == ([12.0, 30.0], [5, 5])
    monkeypatch.setattr(common, "solved_at", lambda returns: 0)
    assert not log.record([{"episode": {"r": 500.0}}], 9)  # solved: the peer's run stops


def test_the_table_warns_when_a_library_left_seeds_unsolved(capsys):
    common = _benchmark("_common")
    rows = [
        {"algo": "peer", "seed": s, "solved": True, "steps": 100.0, "seconds": 10.0, "episodes": 5} for s in (0, 1)
    ] + [
        {"algo": "ours", "seed": 0, "solved": True, "steps": 50.0, "seconds": 2.0, "episodes": 5},
        {"algo": "ours", "seed": 1, "solved": False, "steps": None, "seconds": None, "episodes": None},
    ]
    common.print_table(rows, "peer", "title")
    out = capsys.readouterr().out
    assert "env steps x0.50   seconds x0.20" in out, out
    assert "caution: ours left 1 of 2 seeds unsolved" in out, out
    assert "caution: peer" not in out, out
    assert common.per_seed_ratio(8.0, 4, rows, "peer") == 0.2  # 8 s / 4 seeds over the peer's median 10 s
    assert common.per_seed_ratio(8.0, 4, rows[2:], "peer") != common.per_seed_ratio(8.0, 4, rows[2:], "peer")  # NaN


def test_async_grpo_header_prints_the_threads_each_arm_got(monkeypatch):
    async_grpo = _benchmark("async_grpo")
    monkeypatch.delenv("EDURL_MAX_THREADS", raising=False)
    assert "2 cores; sync: 2 torch threads, async: 1 per side" in async_grpo.header(150, 8, 2, 1)
    monkeypatch.setenv("EDURL_MAX_THREADS", "1")  # capped: the line once said 2 threads for a run that had 1
    assert "2 cores; sync: 1 torch threads, async: 1 per side" in async_grpo.header(150, 8, 2, 1)
