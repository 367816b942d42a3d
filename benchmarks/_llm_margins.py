"""The measured asserts of notebooks 06, 07 and 08, as experiments for ``assert_margins.py``.

Study seed k is the notebook's run with ``seed=k`` everywhere (the SFT warm start, the GRPO problems and
samples) and every other fixed seed of a cell shifted by k * OFFSET, so k = 0 is the notebook's own run.
``threads`` is the torch thread count of SFT and GRPO (the notebooks use 2, their configs' default).
Each experiment trains or loads the SFT warm start of its seed from the cache (``EDURL_CACHE``), so the
three experiments of one seed train it once.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from _args import seed_list  # benchmarks/ is on sys.path when a script runs

from edurl.llm.multiturn import GUESS_RL_SETTINGS

OFFSET = 1_000_000
GRPO_GAIN_MIN = 0.05  # notebook 07's held-out gain after its default run (350 steps); Chapter 7 has the study behind it


def _sft(seed: int, threads: int):
    from edurl import llm

    config = llm.SFTConfig(seed=seed, num_threads=threads)
    model, tokenizer, history, _ = llm.load_or_train_sft(config, progress=False)
    return config, model, tokenizer, history


def sft_warm_start(seed: int, threads: int) -> dict:
    """Notebook 06, cells 5-6 and 13-14: the SFT warm start's validation target and held-out score, and group
    diversity by temperature."""
    from edurl import llm
    from edurl.llm.temperature import group_diversity

    config, model, tokenizer, history = _sft(seed, threads)
    renderer, task, off = llm.ChatMLRenderer(tokenizer), config.task(), seed * OFFSET
    ev = llm.evaluate(model, renderer, task.sample(200, split="test", seed=off))
    by_t = group_diversity(
        model,
        renderer,
        task.sample(64, "test", seed=1 + off),
        [0.0, 0.3, 0.6, 1.0, 1.5],
        group_size=8,
        seed=off,
        progress=False,
    ).set_index("temperature")
    steps = by_t["distinct_answers"].diff().dropna()
    return {
        "sft_target_met": float(history[-1]["target_met"]),
        "sft_steps": len(history),
        "sft_format": ev.format,
        "sft_pass_at_1": ev.pass_at_1,
        "greedy_distinct": float(by_t.loc[0.0, "distinct_answers"]),
        "greedy_frac_mixed": float(by_t.loc[0.0, "frac_mixed"]),
        "distinct_min_step": float(steps.min()),
        "frac_mixed_at_t1": float(by_t.loc[1.0, "frac_mixed"]),
    }


def _short_runs(seed: int, threads: int, runs: dict[str, dict]) -> dict:
    """Notebook 07's ``short_run``: 20 GRPO steps from the SFT start, one per entry of ``runs``."""
    from edurl.llm import SFTConfig
    from edurl.llm.grpo import GRPOConfig, train_grpo

    root = Path(tempfile.mkdtemp(prefix="edurl-margins-"))
    base = dict(
        max_steps=20,
        eval_every=1000,
        num_eval=50,
        progress=False,
        seed=seed,
        num_threads=threads,
        sft=SFTConfig(num_threads=threads),
    )
    return {
        name: train_grpo(GRPOConfig(**{**base, **o, "log_dir": str(root / name)})).metrics for name, o in runs.items()
    }


def grpo_short_runs(seed: int, threads: int) -> dict:
    """Notebook 07, cells 11, 17 and 19: substeps and the clip, the KL penalty both ways, three mistakes."""
    _sft(seed, threads)
    m = _short_runs(
        seed,
        threads,
        {
            "one": dict(loss_fn="ppo"),
            "four": dict(loss_fn="ppo", num_substeps=4, learning_rate=1e-3),
            "free": dict(learning_rate=1e-3, log_kl_ref=True),
            "in_reward": dict(learning_rate=1e-3, kl_coef=4.0),
            "in_loss": dict(learning_rate=1e-3, kl_coef=1.0, kl_penalty="loss"),
            "stale": dict(learning_rate=1e-3, refresh_sampler=False),
            "cold": dict(learning_rate=1e-3, temperature=0.2),
        },
    )
    late = {k: m[k].iloc[5:].mean(numeric_only=True) for k in ("free", "stale", "cold")}  # the notebook's iloc[5:]
    kl_free = m["free"]["optim/kl_ref"].mean()
    return {
        "one_substep_clip_max": float(m["one"]["optim/clip_fraction"].max()),
        "four_substeps_last_clip": float(m["four"]["optim/clip_fraction_last_substep"].mean()),
        "kl_reward_over_free": float(m["in_reward"]["optim/kl_ref"].mean() / kl_free),
        "kl_loss_over_free": float(m["in_loss"]["optim/kl_ref"].mean() / kl_free),
        "stale_kl_v2_ratio": float(
            late["stale"]["optim/kl_sample_train_v2"] / max(late["free"]["optim/kl_sample_train_v2"], 1e-9)
        ),
        "cold_minus_base_frac_mixed": float(
            late["cold"]["env/all/by_group/frac_mixed"] - late["free"]["env/all/by_group/frac_mixed"]
        ),
    }


def grpo_full(seed: int, threads: int) -> dict:
    """Notebook 07, cells 21-24: GRPO with the defaults (350 steps), and its step-matched SFT baseline."""
    from edurl.llm import SFTConfig
    from edurl.llm.grpo import GRPOConfig, train_grpo
    from edurl.llm.sft import continued_sft

    _sft(seed, threads)
    root = Path(tempfile.mkdtemp(prefix="edurl-margins-"))
    config = GRPOConfig(
        log_dir=str(root / "grpo"),
        log_kl_ref=True,
        seed=seed,
        num_threads=threads,
        sft=SFTConfig(num_threads=threads),
        progress=False,
    )
    result = train_grpo(config)
    baseline = continued_sft(replace(config, log_dir=str(root / "continued_sft"), log_kl_ref=False))
    # grpo_gain is checked: notebook 07 asserts it since every warm start meets its SFT target (Chapter 6); the
    # training-correctness rise is recorded, not checked
    correct = result.metrics["env/all/correct"]  # sampled at T = 1: 256 answers a step, far less noisy than 200 tests
    return {
        "grpo_gain": result.final.pass_at_1 - result.start.pass_at_1,
        "grpo_final_format": result.final.format,
        "grpo_train_correct_rise": float(correct.iloc[-50:].mean() - correct.iloc[:50].mean()),
        "sft_minus_grpo": baseline.final.pass_at_1 - result.final.pass_at_1,
        "grpo_start_pass_at_1": result.start.pass_at_1,
        "grpo_final_pass_at_1": result.final.pass_at_1,
    }


BIASED_LENGTH_BONUS = 0.2  # notebook 08's biased rater
# notebook 08's thresholds, set from this study (seeds 0-9, one thread) with a margin
RM_SHARE_MIN, RL_GAIN_MIN, PROXY_RISE_MIN, PEAK_DROP_MIN = 0.9, 0.5, 1.0, 0.1
LEASH_GAP_MIN, DPO_SHARE_MIN, RLHF_OVER_DPO_MIN = 0.2, 0.8, 0.1
RLHF_STEPS = 80


@dataclass
class RLHFSetting:
    """Notebook 08's setting for one study seed: the styled warm start, its pairs labelled by the gold rater, the
    reward-model config, and the held-out judge of a policy (its mean gold score)."""

    seed: int
    threads: int
    sft: object
    policy: object
    renderer: object
    rm_config: object
    data: object
    held_out: list

    @classmethod
    def make(cls, seed: int, threads: int) -> RLHFSetting:
        from edurl import llm
        from edurl.llm import preference as P

        sft = P.rlhf_sft_config(seed=seed, num_threads=threads)
        policy, tokenizer, _, _ = llm.load_or_train_sft(sft, progress=False)
        rm_config = P.RewardModelConfig(
            sft=sft,
            num_train_problems=1024,
            num_test_problems=256,
            epochs=5,
            learning_rate=1e-3,
            eval_every=16,
            seed=seed,
            num_threads=threads,
            progress=False,
        )
        held_out = sft.task().sample(128, split="test", seed=2 + seed * OFFSET)
        renderer = llm.ChatMLRenderer(tokenizer)
        return cls(seed, threads, sft, policy, renderer, rm_config, P.preference_data(rm_config), held_out)

    def gold_of(self, model) -> float:
        from edurl.llm.preference import mean_gold_score

        return mean_gold_score(model, self.renderer, self.held_out, seed=3 + self.seed * OFFSET, max_tokens=40)

    def grpo(self, reward_model, rater, kl_coef: float, log_dir: str):
        """The notebook's ``rlhf_run``: GRPO against ``reward_model`` with a KL penalty in the reward."""
        from edurl.llm.grpo import GRPOConfig, train_grpo
        from edurl.llm.preference import RewardModelReward

        config = GRPOConfig(
            sft=self.sft,
            seed=self.seed,
            max_steps=RLHF_STEPS,
            batch_size=16,
            group_size=8,
            max_tokens=40,
            learning_rate=3e-4,
            kl_coef=kl_coef,
            eval_every=10**6,
            num_eval=50,
            num_threads=self.threads,
            progress=False,
            log_dir=log_dir,
        )
        return train_grpo(config, reward_fn=RewardModelReward(reward_model, self.renderer, rater=rater))

    def dpo(self, **overrides):
        from edurl.llm import preference as P

        config = P.DPOConfig(beta=0.1, seed=self.seed, num_threads=self.threads, progress=False, **overrides)
        return P.train_dpo(self.data, config)


def rlhf(seed: int, threads: int) -> dict:
    """Notebook 08: the reward models (gold and biased rater), GRPO against them, DPO, and the gold scores."""
    from edurl.llm import preference as P

    setting = RLHFSetting.make(seed, threads)
    data, gold_of = setting.data, setting.gold_of
    biased_data = data.relabel(P.Rater(length_bonus=BIASED_LENGTH_BONUS), seed=1 + seed * OFFSET)
    rms = {n: P.train_reward_model(setting.rm_config, d) for n, d in (("gold", data), ("biased", biased_data))}
    raters = {"gold": data.rater, "biased": biased_data.rater}
    root = Path(tempfile.mkdtemp(prefix="edurl-margins-"))

    def rl(name: str, kl_coef: float):
        return setting.grpo(rms[name].model, raters[name], kl_coef, str(root / f"{name}_{kl_coef}"))

    main = rl("gold", 0.2)
    free, leashed = rl("biased", 0.0), rl("biased", 0.2)
    dpo, dpo_fast = setting.dpo(), setting.dpo(learning_rate=5e-4)
    smooth = {k: r.metrics["env/all/reward/gold"].rolling(10).mean() for k, r in (("free", free), ("leashed", leashed))}
    proxy = free.metrics["env/all/reward/proxy"].rolling(10).mean()
    ratio = lambda h: h["test/expected_accuracy"] / h["test/ceiling"]  # noqa: E731
    main_gold = main.metrics["env/all/reward/gold"].rolling(10).mean()
    sft_gold, rl_gold = gold_of(setting.policy), gold_of(main.trainer.model)
    return _derive_rlhf(
        {
            "rm_gold_of_ceiling": ratio(rms["gold"].final),
            "rm_biased_of_ceiling": ratio(rms["biased"].final),
            "sft_gold": sft_gold,
            "rl_gold": rl_gold,
            "rl_train_gold_rise": float(main_gold.iloc[-1] - main_gold.iloc[9]),
            "free_gold_peak_minus_end": float(smooth["free"].max() - smooth["free"].iloc[-1]),
            "free_gold_peak_step": int(smooth["free"].idxmax()),
            "free_proxy_rise": float(proxy.iloc[-1] - proxy.iloc[9]),
            "leashed_minus_free_end_gold": float(smooth["leashed"].iloc[-1] - smooth["free"].iloc[-1]),
            "dpo_of_ceiling": ratio(dpo.final),
            "dpo_chosen_logp_change": dpo.final["test/chosen_logp_change"],
            "dpo_rejected_logp_change": dpo.final["test/rejected_logp_change"],
            "dpo_gold": gold_of(dpo.policy),
            "dpo_seconds": dpo.final["time/train"],
            "dpo_fast_of_ceiling": ratio(dpo_fast.final),
            "dpo_fast_chosen_logp_change": dpo_fast.final["test/chosen_logp_change"],
            "dpo_fast_gold": gold_of(dpo_fast.policy),
            "free_gold_start": float(smooth["free"].iloc[9]),
            "free_gold_end": float(smooth["free"].iloc[-1]),
            "leashed_gold_end": float(smooth["leashed"].iloc[-1]),
            "leashed_proxy_rise": float(
                leashed.metrics["env/all/reward/proxy"].rolling(10).mean().iloc[-1]
                - leashed.metrics["env/all/reward/proxy"].rolling(10).mean().iloc[9]
            ),
            "rl_correct_first10": float(main.metrics["env/all/correct"].iloc[:10].mean()),
            "rl_correct_last10": float(main.metrics["env/all/correct"].iloc[-10:].mean()),
            "rl_held_out_pass_start": main.start.pass_at_1,
            "rl_held_out_pass_end": main.final.pass_at_1,
            "rm_seconds": rms["gold"].final["time/train"],
            "rl_seconds": float(main.metrics["time/total"].iloc[-1]),
        }
    )


def _derive_rlhf(stats: dict) -> dict:
    """Notebook 08's asserted differences, from the recorded values."""
    stats.setdefault("rl_gold_gain", stats["rl_gold"] - stats["sft_gold"])
    stats.setdefault("dpo_gold_minus_far", stats["dpo_gold"] - stats["dpo_fast_gold"])
    stats.setdefault("rl_minus_dpo_gold", stats["rl_gold"] - stats["dpo_gold"])
    return stats


# notebook 09's settings and thresholds (set from this study: seeds 0-9, one thread, with a margin)
GUESS_SFT = dict(game="guess_number", max_steps=600, batch_size=16)
GUESS_RL = dict(GUESS_RL_SETTINGS, max_steps=40)
GUESS_ILLEGAL_MAX, CREDIT_GAP_MIN, GUESS_CENTRAL_GAIN_MIN, CALC_RATE_GAIN_MIN = 0.1, 0.1, 0.05, 0.25
# recorded, not asserted (seeds 0-9, one thread): the win rate's gain in 40 steps (-5.9 to +18.4 points, median
# +2.3), and the calculator's accuracy (with the tool after RL 3.5 % to 96 %: on seeds 1, 5 and 9 the warm start never
# learned to copy the tool's result into its answer, and 30 RL steps did not teach it)
CALC_SFT = dict(game="calculator", max_steps=1000, batch_size=32)
CALC_RL = dict(max_steps=30, batch_size=8, group_size=8, num_eval=100)


def multiturn_guess(seed: int, threads: int) -> dict:
    """Notebook 09, sections 4-6: the guess-the-number warm start, the credit correlations, and 40 RL steps."""
    import numpy as np

    from edurl import llm
    from edurl.llm import envs
    from edurl.llm import multiturn as MT

    off, root = seed * OFFSET, Path(tempfile.mkdtemp(prefix="edurl-margins-"))
    tokenizer = llm.build_char_tokenizer()
    renderer = llm.ChatMLRenderer(tokenizer)
    guess_sft = MT.GameSFTConfig(**GUESS_SFT, seed=seed, num_threads=threads)
    model, _, _, _ = MT.load_or_train_game_sft(guess_sft, progress_bar=False)
    sampler = llm.SamplingClient(model, tokenizer)

    def guess_eval(m):
        return MT.evaluate_game(m, tokenizer, "guess_number", seed=off, temperature=1.0, samples=8)

    before = guess_eval(model)
    builders = MT.game_builders("guess_number", renderer, 16, 7 + off, "train", 8, shaped=True)
    groups = envs.do_group_rollouts(builders, sampler, llm.SamplingParams(max_tokens=24, temperature=1.0, seed=3 + off))
    central, at_end, shaped = [], [], []
    for g in groups:
        won = [t.transitions[-1].metrics["win"] for t in g.trajectories]
        for traj, adv_end, adv_turns in zip(g.trajectories, np.array(won) - np.mean(won), g.turn_advantages(0.0)):
            share = [t.metrics["central"] * (k + 1) for k, t in enumerate(traj.transitions)]
            central += list(np.diff([0.0] + share))
            at_end += [adv_end] * traj.num_turns
            shaped += adv_turns
    corr_end, corr_shaped = np.corrcoef(central, at_end)[0, 1], np.corrcoef(central, shaped)[0, 1]
    rl = MT.MultiTurnConfig(
        sft=guess_sft,
        **GUESS_RL,
        eval_every=40,
        seed=seed,
        num_threads=threads,
        log_dir=str(root / "g"),
        progress=False,
    )
    guess = MT.train_multiturn(rl)
    after = guess_eval(guess.trainer.model)
    return {
        "guess_start_win": before["win"],
        "guess_start_central": before["central"],
        "guess_start_illegal": before["illegal"],
        "credit_corr_end": float(corr_end),
        "credit_corr_shaped": float(corr_shaped),
        "guess_end_win": after["win"],
        "guess_end_central": after["central"],
        "guess_rl_seconds": float(guess.metrics["time/sample"].sum() + guess.metrics["time/train"].sum()),
    }


def multiturn_calc(seed: int, threads: int) -> dict:
    """Notebook 09, section 7: the calculator's warm start and 30 RL steps, sampled with and without the tool."""
    from edurl import llm
    from edurl.llm import multiturn as MT

    off, root = seed * OFFSET, Path(tempfile.mkdtemp(prefix="edurl-margins-"))
    tokenizer = llm.build_char_tokenizer()
    calc_sft = MT.GameSFTConfig(**CALC_SFT, seed=seed, num_threads=threads)
    calc_model, _, _, _ = MT.load_or_train_game_sft(calc_sft, progress_bar=False)

    def calc_eval(m, tool, temperature=1.0):  # sampled, as RL samples: 100 problems x 2 episodes; or greedy
        return MT.evaluate_game(
            m, tokenizer, "calculator", 100, off, temperature=temperature, samples=2, tool_enabled=tool
        )

    calc_start = {tool: calc_eval(calc_model, tool) for tool in (True, False)}
    calc_start_greedy = calc_eval(calc_model, True, temperature=0.0)
    rl = MT.MultiTurnConfig(
        sft=calc_sft, **CALC_RL, eval_every=30, seed=seed, num_threads=threads, log_dir=str(root / "c"), progress=False
    )
    calc = MT.train_multiturn(rl)
    calc_end = {tool: calc_eval(calc.trainer.model, tool) for tool in (True, False)}
    calc_end_greedy = calc_eval(calc.trainer.model, True, temperature=0.0)
    return {
        "calc_start_tool": calc_start[True]["correct"],
        "calc_start_tool_rate": calc_start[True]["used_tool"],
        "calc_start_no_tool": calc_start[False]["correct"],
        "calc_end_tool": calc_end[True]["correct"],
        "calc_end_tool_rate": calc_end[True]["used_tool"],
        "calc_end_no_tool": calc_end[False]["correct"],
        "calc_start_greedy": calc_start_greedy["correct"],
        "calc_end_greedy": calc_end_greedy["correct"],
        "calc_rl_seconds": float(calc.metrics["time/sample"].sum() + calc.metrics["time/train"].sum()),
    }


# notebook 10's settings (the default GRPO recipe from the Chapter 6 warm start, 60 steps)
OFF_STEPS = 60
STALE_KS = (2, 8)
STALE_LOSSES = ("importance_sampling", "ppo", "cispo")
SWEEP_KS = (1, 2, 4, 8)  # the sweep, k = 0 (on-policy) being the shared baseline
BUFFER_GROUPS = 320  # per source policy: the warm start and the online run's steps 20 and 40
OFFLINE_RUNS = (("dro", 0.1, "mean"), ("dro", 0.0, "mean"), ("dro", 0.1, "soft"), ("ppo", 0.1, "mean"))


def _off_policy_base(seed: int, threads: int):
    """Notebook 10's GRPO run: the recipe from the Chapter 6 warm start with 8 completions per problem (the
    recipe's default until Chapter 7 moved to 4; this study and notebook 10 keep 8), OFF_STEPS steps."""
    from edurl.llm.grpo import GRPOConfig

    return GRPOConfig(
        seed=seed, group_size=8, max_steps=OFF_STEPS, num_threads=threads, progress=False, eval_every=OFF_STEPS
    )


def _stale_runs(seed: int, threads: int, ks, root: Path, **online) -> dict:
    """Notebook 10's staleness sweep: the on-policy run (k = 0, with ``online``'s extra settings) and, for each k in
    ``ks`` and each loss, the run whose batch s is sampled with the weights of step max(0, s - k) (in turn with the
    trainer: the same batches as a concurrent sampler, reproducibly). Returns the recorded statistics: held-out
    pass@1 after OFF_STEPS steps, mean kl_sample_train_v2 and clip fraction, per run."""
    from dataclasses import replace

    from edurl.llm.grpo import train_grpo

    base, stats = _off_policy_base(seed, threads), {}

    def record(name, result):
        m = result.metrics
        stats[f"{name}_pass"] = result.final.pass_at_1
        stats[f"{name}_kl_v2"] = float(m["optim/kl_sample_train_v2"].mean())
        stats[f"{name}_clip"] = float(m["optim/clip_fraction"].mean())

    on_policy = train_grpo(replace(base, log_dir=str(root / "online"), **online))
    stats["start_pass"] = on_policy.start.pass_at_1
    record("k0", on_policy)
    for k in ks:
        for loss in STALE_LOSSES:
            c = replace(base, loss_fn=loss, max_steps_off_policy=k, concurrent_sampler=False)
            record(f"k{k}_{loss}", train_grpo(replace(c, log_dir=str(root / f"k{k}_{loss}"))))
    return stats


def staleness_sweep(seed: int, threads: int) -> dict:
    """Issue 16's sweep, k = 0, 1, 2, 4, 8 with three losses (the notebook runs k = 0, 2, 8): read it with
    ``python benchmarks/staleness_sweep.py --load F``."""
    return _stale_runs(seed, threads, SWEEP_KS, Path(tempfile.mkdtemp(prefix="edurl-margins-")))


def off_policy(seed: int, threads: int) -> dict:
    """Notebook 10: the staleness sweep (k = 0, 2, 8 with three losses) and offline RL from a buffer logged by the
    warm start and the on-policy run's checkpoints."""
    from dataclasses import replace

    from edurl.llm.loop import make_training_client
    from edurl.llm.offline import collect_buffer, train_offline

    root, base = Path(tempfile.mkdtemp(prefix="edurl-margins-")), _off_policy_base(seed, threads)
    third = OFF_STEPS // 3  # checkpoints at a third and two thirds of the run: steps 20 and 40
    stats = _stale_runs(seed, threads, STALE_KS, root, save_every=third)
    trainer, renderer, task = make_training_client(replace(base, log_dir=str(root / "buffer")))
    samplers = {"sft": trainer.save_weights_and_get_sampling_client("sft")}
    for s in (third, 2 * third):
        trainer.load_state(root / "online" / "checkpoints" / f"step_{s:06d}")
        samplers[f"grpo@{s}"] = trainer.save_weights_and_get_sampling_client(f"grpo@{s}")
    buffer = collect_buffer(samplers, renderer, task, BUFFER_GROUPS, seed=seed, progress_bar=False)
    for source, row in buffer.summary().iterrows():
        stats[f"buffer_{source}_correct"] = float(row["correct"])
    for loss, beta, advantage in OFFLINE_RUNS:
        c = replace(base, loss_fn=loss, dro_beta=beta, log_dir=str(root / f"off_{loss}_{beta}_{advantage}"))
        result = train_offline(c, buffer, advantage)
        stats[f"off_{loss}_{beta}_{advantage}_pass"] = result.final.pass_at_1
        stats[f"off_{loss}_{beta}_{advantage}_kl_v2"] = float(result.metrics["optim/kl_sample_train_v2"].iloc[-1])
    return stats


def stale_gradients(seed: int, threads: int) -> dict:
    """Notebook 10, section 2: how far ppo's and cispo's gradients are from importance_sampling's on a batch sampled
    at step 0, scored by the weights of step 0 (fresh) and after 8 more GRPO steps (stale)."""
    from dataclasses import replace

    import torch

    from edurl import llm
    from edurl.llm.grpo import GRPOConfig
    from edurl.utils import torch_threads

    base = GRPOConfig(max_steps=OFF_STEPS, eval_every=OFF_STEPS, num_threads=threads, device="cpu", seed=seed)
    trainer, renderer, task = llm.make_training_client(replace(base, log_dir=tempfile.mkdtemp(prefix="edurl-margins-")))
    stop = renderer.get_stop_sequences()
    batch = llm.collect(base, trainer.save_weights_and_get_sampling_client("step 0"), renderer, task, 0, stop).datums

    def gradient(loss):
        trainer.model.zero_grad(set_to_none=True)
        out = trainer.forward_backward(batch, loss, aggregation=base.aggregation, max_tokens=base.max_tokens).result()
        return torch.cat([p.grad.flatten() for p in trainer.trainable_parameters()]), out.metrics

    def gaps(label):
        g, _ = gradient("importance_sampling")
        stats = {}
        for loss in ("ppo", "cispo"):
            h, m = gradient(loss)
            stats[f"{label}_{loss}_gap"] = float((h - g).norm() / g.norm())
            stats[f"{label}_{loss}_clip"] = m["optim/clip_fraction"]
        return stats

    with torch_threads(threads):
        stats = gaps("fresh")
        for step in range(8):
            sampler = trainer.save_weights_and_get_sampling_client()
            llm.update(base, trainer, llm.collect(base, sampler, renderer, task, 1 + step, stop))
        stats.update(gaps("stale"))
    return stats


def _derive_multiturn(stats: dict) -> dict:
    """Notebook 09's asserted differences, from the recorded values."""
    if "guess_end_win" in stats:
        stats.setdefault("credit_gap", stats["credit_corr_shaped"] - stats["credit_corr_end"])
        stats.setdefault("guess_win_gain", stats["guess_end_win"] - stats["guess_start_win"])
        stats.setdefault("guess_central_gain", stats["guess_end_central"] - stats["guess_start_central"])
    if "calc_end_tool" in stats:
        stats.setdefault("calc_tool_gap", stats["calc_end_tool"] - stats["calc_end_no_tool"])
        stats.setdefault("calc_gain", stats["calc_end_tool"] - stats["calc_start_tool"])
        stats.setdefault("calc_tool_rate_gain", stats["calc_end_tool_rate"] - stats["calc_start_tool_rate"])
    return stats


def derived(row: dict) -> dict:
    """A recorded run with the statistics derived from it, also for runs recorded before they were added."""
    derive = {"rlhf": _derive_rlhf, "multiturn_guess": _derive_multiturn, "multiturn_calc": _derive_multiturn}.get(
        row.get("experiment")
    )
    return derive(row) if derive else row


EXPERIMENTS = {
    "sft_warm_start": (sft_warm_start, True),
    "grpo_short_runs": (grpo_short_runs, True),
    "grpo_full": (grpo_full, True),
    "rlhf": (rlhf, True),
    "multiturn_guess": (multiturn_guess, True),
    "multiturn_calc": (multiturn_calc, True),
    "off_policy": (off_policy, True),
    "staleness_sweep": (staleness_sweep, True),
    "stale_gradients": (stale_gradients, True),
}


def checks(Check) -> list:
    """The asserts of notebooks 06 and 07, as ``Check`` rows of assert_margins.py."""
    inf = math.inf
    return [
        Check("06", 'assert history[-1]["target_met"]', "sft_warm_start", "sft_target_met", low=1, inclusive=True),
        Check("06", "assert sft_eval.format >= 0.9", "sft_warm_start", "sft_format", low=0.9, inclusive=True),
        Check(
            "06",
            "assert 0.15 <= sft_eval.pass_at_1 <= 0.6",
            "sft_warm_start",
            "sft_pass_at_1",
            0.15,
            0.6,
            inclusive=True,
        ),
        Check(
            "06",
            'assert by_t.loc[0.0, "distinct_answers"] == 1.0',
            "sft_warm_start",
            "greedy_distinct",
            1.0,
            1.0,
            inclusive=True,
        ),
        Check(
            "06", 'by_t.loc[0.0, "frac_mixed"] == 0.0', "sft_warm_start", "greedy_frac_mixed", 0.0, 0.0, inclusive=True
        ),
        Check(
            "06",
            'assert by_t["distinct_answers"].is_monotonic_increasing',
            "sft_warm_start",
            "distinct_min_step",
            low=0,
            inclusive=True,
        ),
        Check("06", 'assert by_t.loc[1.0, "frac_mixed"] > 0.3', "sft_warm_start", "frac_mixed_at_t1", low=0.3),
        Check(
            "07",
            'assert (one["optim/clip_fraction"] == 0).all()',
            "grpo_short_runs",
            "one_substep_clip_max",
            -inf,
            0.0,
            inclusive=True,
        ),
        Check(
            "07",
            'assert four["optim/clip_fraction_last_substep"].mean() > 0',
            "grpo_short_runs",
            "four_substeps_last_clip",
            low=0,
        ),
        Check(
            "07",
            'assert in_reward["optim/kl_ref"].mean() < free["optim/kl_ref"].mean()',
            "grpo_short_runs",
            "kl_reward_over_free",
            high=1,
        ),
        Check(
            "07",
            'assert in_loss["optim/kl_ref"].mean() < free["optim/kl_ref"].mean()',
            "grpo_short_runs",
            "kl_loss_over_free",
            high=1,
        ),
        Check(
            "07",
            'assert mistakes.loc["stale sampler", "optim/kl_sample_train_v2"] > 100',
            "grpo_short_runs",
            "stale_kl_v2_ratio",
            low=100,
        ),
        Check(
            "07",
            'assert mistakes.loc["temperature 0.2", "env/all/by_group/frac_mixed"] <',
            "grpo_short_runs",
            "cold_minus_base_frac_mixed",
            high=0,
        ),
        Check("07", "assert result.final.format >= 0.95", "grpo_full", "grpo_final_format", low=0.95, inclusive=True),
        Check("07", "assert gain >=", "grpo_full", "grpo_gain", low=GRPO_GAIN_MIN, inclusive=True),
        Check("07", "assert baseline.final.pass_at_1 > result.final.pass_at_1", "grpo_full", "sft_minus_grpo", low=0),
        Check("08", "assert rm_share >=", "rlhf", "rm_gold_of_ceiling", low=RM_SHARE_MIN, inclusive=True),
        Check("08", "assert rlhf_gold - sft_gold >=", "rlhf", "rl_gold_gain", low=RL_GAIN_MIN, inclusive=True),
        Check(
            "08",
            "assert proxy.iloc[-1] - proxy.iloc[9] >=",
            "rlhf",
            "free_proxy_rise",
            low=PROXY_RISE_MIN,
            inclusive=True,
        ),
        Check(
            "08",
            "assert gold.max() - gold.iloc[-1] >=",
            "rlhf",
            "free_gold_peak_minus_end",
            low=PEAK_DROP_MIN,
            inclusive=True,
            log=True,  # positive and skewed: a policy that lost every boxed answer ends at -4
        ),
        Check(
            "08",
            'assert leashed["env/all/reward/gold"].iloc[-1] - gold.iloc[-1] >=',
            "rlhf",
            "leashed_minus_free_end_gold",
            low=LEASH_GAP_MIN,
            inclusive=True,
            log=True,  # positive and skewed: a policy that lost every boxed answer ends at -4
        ),
        Check("08", "assert dpo_share >=", "rlhf", "dpo_of_ceiling", low=DPO_SHARE_MIN, inclusive=True),
        Check(
            "08", "assert rlhf_gold - dpo_gold >=", "rlhf", "rl_minus_dpo_gold", low=RLHF_OVER_DPO_MIN, inclusive=True
        ),
        Check("09", 'assert before["illegal"] <', "multiturn_guess", "guess_start_illegal", high=GUESS_ILLEGAL_MAX),
        Check(
            "09",
            "assert corr.iloc[1] - corr.iloc[0] >=",
            "multiturn_guess",
            "credit_gap",
            low=CREDIT_GAP_MIN,
            inclusive=True,
        ),
        Check(
            "09",
            'assert after["central"] - before["central"] >=',
            "multiturn_guess",
            "guess_central_gain",
            low=GUESS_CENTRAL_GAIN_MIN,
            inclusive=True,
        ),
        Check(
            "09",
            'assert with_tool["used_tool"] - calc_before.loc["sampled, with the tool", "used_tool"] >=',
            "multiturn_calc",
            "calc_tool_rate_gain",
            low=CALC_RATE_GAIN_MIN,
            inclusive=True,
        ),
    ]


DETERMINISTIC = [  # (notebook, assert, why no study is needed)
    ("06", "assert prompt == tokenizer.apply_chat_template(", "the renderer against the chat template"),
    ("06", "assert abs(from_sampler - per_token.sum().item()) < 1e-4", "two computations of the same log-prob"),
    ("06", 'assert table["reward"].tolist() == [1.0, 0.0, -0.1, 0.9]', "hand-written replies"),
    ("06", "assert datum.model_input.length == len(prompt) + len(completion.tokens) - 1", "the datum layout"),
    ("07", "assert torch.allclose(worked, torch.tensor([[0.375, -0.125, -0.625, 0.375]]))", "a worked example"),
    ("07", 'assert out.metrics["optim/clip_fraction"] == 0.0', "on-policy: ratio 1 up to rounding"),
    ("07", 'assert torch.all(grads["ppo", 1.0][above] == 0)', "autograd of closed forms"),
    ("07", "assert close(weights.iloc[1, 0], 5 * weights.iloc[1, 1])", "autograd of closed forms"),
    ("07", 'assert abs(est["k1"] - exact) < 1e-12', "exact expectations"),
    ("07", "assert baseline.start.pass_at_1 == result.start.pass_at_1", "the same start and problems"),
    ("08", "assert abs(p - torch.sigmoid(torch.tensor(4.0)).item()) < 1e-6", "Bradley-Terry on hand-written replies"),
    ("08", "assert abs(P.ceiling([0.9, 0.5, 0.2]) - (0.9 + 0.5 + 0.8) / 3) < 1e-12", "a worked example"),
    ("08", "assert abs(shaped.item() - 0.7) < 1e-6", "a worked example"),
    ("09", "assert [t.reward for t in episode.transitions] == [0.0, 0.0, 0.0, 1.0]", "a scripted game"),
    ("09", 'assert f["mask"].sum() == replies', "the datum layout of a scripted game"),
    ("09", "assert abs(merged - per_turn) <= 1e-4 * abs(per_turn)", "two computations of the same loss"),
    ("09", 'assert v_mask.implementation(obs, acts) == f["mask"].tolist()', "the exercise against the library"),
    ("09", "assert not envs.is_prefix_consistent(broken)", "a tokenizer trained on fixed text"),
    ("09", 'assert kl["masked"] < 1e-3', "on-policy log-probs agree up to rounding; unsampled tokens have none"),
    ("09", 'assert tool_episode.transitions[-1].metrics["correct"] == 1.0', "a scripted episode"),
    ("09", "assert len(played.trajectories) == 8", "the rollout's bookkeeping"),
]


def summary(paths: list[str]) -> str:
    """Every recorded statistic of the runs in the JSON-lines files ``paths`` (one study run each), per experiment
    and variant: its median (min to max) over seeds and the number of seeds, one column per file, so that two
    study runs can be read side by side. The chapters' unasserted study numbers come from this table."""
    import json
    import statistics

    studies = [[derived(json.loads(line)) for line in open(path, encoding="utf-8") if line.strip()] for path in paths]
    groups = sorted({(r["experiment"], r.get("variant", "")) for rows in studies for r in rows})
    lines = []
    for experiment, variant in groups:
        runs = [
            [r for r in rows if (r["experiment"], r.get("variant", "")) == (experiment, variant)] for rows in studies
        ]
        lines.append(
            f"\n{experiment} ({variant}): median (min to max) [seeds]; one column per file: {', '.join(paths)}"
        )
        first = next(rows[0] for rows in runs if rows)
        keys = [k for k, v in first.items() if isinstance(v, (int, float)) and k != "seed"]
        for key in keys:
            cells = []
            for rows in runs:
                values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
                cells.append(
                    f"{statistics.median(values):.4g} ({min(values):.4g} to {max(values):.4g}) [{len(values)}]"
                    if values
                    else "-"
                )
            lines.append(f"  {key:<32} " + "   ".join(f"{c:<36}" for c in cells))
    return "\n".join(lines)


def main() -> None:
    """Run experiments over seeds in this process, appending one JSON line per run to ``--out``, so that
    several processes (e.g. one per core) can share the work and a partial study keeps its runs."""
    import argparse
    import json
    import os
    import time

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--experiments", default=",".join(EXPERIMENTS))
    parser.add_argument("--seeds", type=seed_list, default="0,1,2,3,4,5,6,7,8,9", help="comma-separated study seeds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variant", default="threads=1", help="the name the rows carry")
    parser.add_argument("--out", help="append the runs to this JSON-lines file")
    parser.add_argument(
        "--summary", help="comma-separated --out files: print each statistic's median (min to max), and run nothing"
    )
    args = parser.parse_args()
    if args.summary:
        print(summary(args.summary.split(",")))
        return
    if not args.out:
        parser.error("--out is required to run experiments (or pass --summary FILES to read earlier runs)")
    for seed in args.seeds:
        for name in args.experiments.split(","):
            try:  # a claim file per (experiment, seed, variant): processes sharing --out never run one twice
                os.close(os.open(f"{args.out}.{name}.{seed}.{args.variant}.claim", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            t0 = time.perf_counter()
            stats = EXPERIMENTS[name][0](seed, args.threads)
            row = {
                "experiment": name,
                "variant": args.variant,
                "seed": seed,
                "seconds": round(time.perf_counter() - t0, 2),
                **stats,
            }
            print(json.dumps(row), flush=True)
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
