"""GRPO on the course's arithmetic task, written against the official ``tinker`` SDK and nothing else for training.

The loop has the shape of the Tinker Cookbook's ``rl_loop.py``: one LoRA training client; every step saves the
weights for a sampler, sends one sample request per problem (all in flight at once), grades the completions,
centres the rewards within each group, builds Tinker datums (no mask: the prompt's positions carry advantage 0
and sampling log-prob 0), and submits ``forward_backward`` and ``optim_step`` back to back. Only the data is the
course's: the prompts come from ``ArithmeticTask`` and ``ChatMLRenderer``, the rewards from
``edurl.llm.rewards.grade``, and the tokenizer from the training client (``get_tokenizer()``).

    python -m edurl.serve --port 8000 --api-key tml-local-key                     # in one terminal
    TINKER_API_KEY=tml-local-key python -m edurl.recipes.tinker_rl_loop --base-url http://127.0.0.1:8000
    python -m edurl.recipes.tinker_rl_loop --help                                 # every field

For Tinker's hosted service, leave ``--base-url`` out, use your own key, and name a ``--base-model`` that it
serves (a ChatML model such as a Qwen instruct model, since the renderer writes ChatML).

The problems of step ``s`` and the seed of each sample request are those of ``train_grpo`` with
``sample_per_problem=True`` and the same ``seed``, so a run here and one in process see the same problems
(``benchmarks/serve_grpo.py`` compares the two). Writes ``<log_dir>/metrics.jsonl`` (``load_metrics`` reads it):
one row per step, as ``train_grpo`` writes them: the reward, accuracy and loss, ``optim/logprob_diff_max`` (the largest gap between the training
log-probs that ``forward_backward`` returns and the sampler's: on-policy, float rounding only), and the held-out
greedy accuracy: ``test/start_pass_at_1`` before the first step (in row 0), ``test/pass_at_1`` after every
``eval_every`` steps and after the last. Its learning curves go to ``<log_dir>/learning_curves.png``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from edurl._checks import check_fields
from edurl.llm.loop import group_seed, problem_seed
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.rewards import grade
from edurl.llm.sft import SFTConfig
from edurl.metrics import MetricsLogger, load_metrics
from edurl.recipes._cli import parse_config, refuse, run_as_script, save_figure

RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro")


@dataclass
class TinkerLoopConfig:
    base_url: str | None = None
    """The server: e.g. http://127.0.0.1:8000 for ``python -m edurl.serve``; None is Tinker's hosted service."""
    base_model: str = "edurl/tiny-arithmetic"
    """The model to train: edurl.serve knows Chapter 6's checkpoint by this name, or takes a checkpoint folder."""
    lora_rank: int = 8
    """Rank of the LoRA adapter the server trains."""
    batch_size: int = 32
    """P: problems per step."""
    group_size: int = 8
    """G: completions per problem."""
    max_steps: int = 40
    """GRPO steps: one batch sampled, graded and trained on per step."""
    learning_rate: float = 3e-4
    """Adam's learning rate (``types.AdamParams``)."""
    grad_clip_norm: float = 1.0
    """Clip the gradient's global norm before Adam (edurl's default; Tinker's 0.0 turns clipping off)."""
    adam_eps: float = 1e-8
    """Adam's epsilon (edurl's default; Tinker's is 1e-12)."""
    loss_fn: str = "importance_sampling"
    """The server's loss: importance_sampling, ppo, cispo or dro (dro also penalises the maskless prompt: README)."""
    dro_beta: float = 0.05
    """dro's beta, sent as ``loss_fn_config={"beta": dro_beta}`` (the other losses take the server's defaults)."""
    max_tokens: int = 16
    """Most tokens a completion may have."""
    temperature: float = 1.0
    """Sampling temperature of the training samples (evaluation is greedy). Only 1.0: Tinker's ``forward_backward``
    has no temperature, so the server scores at 1, and samples drawn at another one would be off-policy."""
    eval_every: int = 20
    """Steps between held-out evaluations (also one before the first step and one after the last)."""
    num_eval: int = 200
    """Held-out test problems (the same for every seed's evaluations)."""
    seed: int = 0
    """Seeds the LoRA initialisation, the problems and every sample request."""
    log_dir: str = "runs/tinker_rl_loop"
    """Where metrics.jsonl and config.json go (an earlier run there is replaced)."""
    progress: bool = True
    """Show a tqdm progress bar."""

    def __post_init__(self) -> None:
        check_fields(  # bools, 2.5, NaN and inf were taken as counts (True as 1); every bool field a bool
            self,
            positive_int=("lora_rank", "batch_size", "group_size", "max_steps", "max_tokens", "eval_every", "num_eval"),
            nonneg=("learning_rate", "grad_clip_norm", "dro_beta"),
            positive=("adam_eps",),
            finite=("temperature",),
            nonneg_int=("seed",),
        )
        if isinstance(self.log_dir, os.PathLike):
            self.log_dir = os.fspath(self.log_dir)  # a pathlib.Path, as a str (config.json holds it)
        if not isinstance(self.log_dir, str) or not self.log_dir:
            raise ValueError(f"TinkerLoopConfig.log_dir must be a folder path, got {self.log_dir!r}")
        if self.base_url is not None and not (
            isinstance(self.base_url, str) and self.base_url.startswith(("http://", "https://"))
        ):  # "127.0.0.1:8000" was reported as no server answering ("unknown url type")
            raise ValueError(
                f"TinkerLoopConfig.base_url must be an address with its scheme, e.g. http://127.0.0.1:8000, or None "
                f"for Tinker's hosted service; got {self.base_url!r}"
            )
        if self.loss_fn not in RL_LOSSES:
            raise ValueError(f"loss_fn must be one of {list(RL_LOSSES)} (Tinker's RL losses), got {self.loss_fn!r}")
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2: a group of one has no baseline, so every advantage is 0")
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0, got {self.temperature!r}: the G completions of a problem must differ for "
                "GRPO to learn, and greedy sampling (0) makes every group uniform, so every step would skip all of "
                "them and train on nothing. Held-out evaluation is greedy already."
            )
        if self.temperature != 1.0:
            # the ratio exp(train - sampling) would not be 1 on-policy: edurl.serve's sampler reports log p at T,
            # its forward_backward scores log p at 1 (the request has no temperature field)
            raise ValueError(
                f"temperature must be 1.0 here, got {self.temperature!r}: Tinker's forward_backward takes no "
                "temperature, so the server scores the training log-probs at 1, while the sampler reports them at "
                "the sampling temperature. Samples drawn at another temperature are off-policy before any update "
                "(ppo clips them, importance_sampling reweights them). Sample at 1.0 here, or use train_grpo "
                "(GRPOConfig.temperature), which scores at the sampling temperature."
            )


def evaluate(sampler, renderer, problems, config: TinkerLoopConfig) -> float:
    """Greedy held-out accuracy: one request per problem, all in flight."""
    from tinker import types

    params = types.SamplingParams(max_tokens=config.max_tokens, temperature=0.0, stop=renderer.get_stop_sequences())
    futures = [
        sampler.sample(types.ModelInput.from_ints(renderer.build_generation_prompt(p.messages())), 1, params)
        for p in problems
    ]
    correct = 0.0
    for problem, future in zip(problems, futures):
        seq = future.result().sequences[0]
        message, complete = renderer.parse_response(list(seq.tokens), seq.stop_reason)
        correct += grade(message["content"], problem.answer, complete=complete).correct
    return correct / len(problems)


def make_datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float):
    """A Tinker RL datum: inputs and targets shifted by one; the prompt's positions have advantage 0."""
    from tinker import types

    full = prompt + tokens
    n_prompt = len(prompt) - 1  # targets that are prompt tokens
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": [0.0] * n_prompt + logprobs,
            "advantages": [0.0] * n_prompt + [advantage] * len(tokens),
        },
    )


def main(argv: list[str] | None = None) -> Path:
    config = parse_config(TinkerLoopConfig, argv)
    try:
        import tinker
        from tinker import types
    except ImportError:
        raise SystemExit(
            "this recipe drives the official tinker SDK: pip install -e '.[tinker]' (Python >= 3.11)"
        ) from None
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    if not os.environ.get("TINKER_API_KEY"):
        refuse(
            "set TINKER_API_KEY to the server's key (for a local one: python -m edurl.serve --api-key tml-local-key)"
        )
    if config.base_url is not None:
        _check_server(config.base_url)
    service = tinker.ServiceClient(base_url=config.base_url)  # the key comes from TINKER_API_KEY
    with service:  # the session is finished when the run ends, however it ends, and the server lets it go
        return _training_loop(config, service, types)


def _check_server(base_url: str) -> None:
    """End with the reason when nothing answers at ``base_url``: the SDK retries for about five minutes, silently."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(base_url, timeout=5)
    except urllib.error.HTTPError:  # a server answered, if only to say no
        return
    except (urllib.error.URLError, OSError, ValueError) as err:
        refuse(
            f"--base-url {base_url}: no server answers ({getattr(err, 'reason', err)}). Start one first, e.g. "
            "python -m edurl.serve --port 8000 --api-key tml-local-key, and pass its address"
        )


def _training_loop(config: TinkerLoopConfig, service, types) -> Path:
    """The loop itself, on an open ``service``: what :func:`main` runs."""
    training = service.create_lora_training_client(
        base_model=config.base_model, rank=config.lora_rank, seed=config.seed
    ).result()
    renderer = ChatMLRenderer(training.get_tokenizer())
    stop = renderer.get_stop_sequences()
    task = SFTConfig().task()  # Chapter 6's task: the problems edurl/tiny-arithmetic was warm-started on
    test = task.sample(config.num_eval, split="test", seed=config.seed)
    adam = types.AdamParams(
        learning_rate=config.learning_rate, eps=config.adam_eps, grad_clip_norm=config.grad_clip_norm
    )
    log_dir = Path(config.log_dir)
    with MetricsLogger(log_dir, if_exists="overwrite") as logger:  # closed also when a step raises
        (log_dir / "config.json").write_text(json.dumps(asdict(config), indent=1))

        sampler = training.save_weights_and_get_sampling_client(name="step_0").result()
        fresh = True  # does the sampler hold the current weights?
        start = evaluate(sampler, renderer, test, config)
        bar = tqdm(range(config.max_steps), desc="GRPO via tinker", disable=not config.progress)
        P, G = config.batch_size, config.group_size
        for step in bar:
            if not fresh:
                sampler = training.save_weights_and_get_sampling_client(name=f"step_{step}").result()
                fresh = True
            # sample: one request per problem, each seeded as train_grpo(sample_per_problem=True) seeds it
            seed = problem_seed(config.seed, step)
            problems = task.sample(P, split="train", seed=seed)
            prompts = [renderer.build_generation_prompt(p.messages()) for p in problems]
            futures = [
                sampler.sample(
                    types.ModelInput.from_ints(prompt),
                    G,
                    types.SamplingParams(
                        max_tokens=config.max_tokens,
                        temperature=config.temperature,
                        stop=stop,
                        seed=group_seed(seed, i),
                    ),
                )
                for i, prompt in enumerate(prompts)
            ]
            groups = [f.result().sequences for f in futures]
            # grade, centre per group, and keep the groups whose rewards differ (the others have advantage 0)
            datums, sampled, rewards, correct, formats = [], [], [], [], []
            for problem, prompt, group in zip(problems, prompts, groups):
                grades = []
                for seq in group:
                    message, complete = renderer.parse_response(list(seq.tokens), seq.stop_reason)
                    grades.append(grade(message["content"], problem.answer, complete=complete))
                row = [g.reward for g in grades]
                rewards += row
                correct += [g.correct for g in grades]
                formats += [g.format for g in grades]
                if max(row) == min(row):
                    continue
                mean = sum(row) / len(row)
                for seq, r in zip(group, row):
                    datums.append(make_datum(prompt, list(seq.tokens), list(seq.logprobs), r - mean))
                    sampled.append((len(prompt) - 1, list(seq.logprobs)))
            metrics = {
                "env/all/reward/total": sum(rewards) / len(rewards),
                "env/all/correct": sum(correct) / len(correct),
                "env/all/format": sum(formats) / len(formats),
                "env/all/by_group/frac_mixed": len(datums) / (P * G),
            }
            if datums:
                loss_fn_config = {"beta": config.dro_beta} if config.loss_fn == "dro" else None
                backward = training.forward_backward(datums, loss_fn=config.loss_fn, loss_fn_config=loss_fn_config)
                update = training.optim_step(adam)  # submitted behind it: the server runs them in order
                out = backward.result()
                update.result()
                fresh = False
                metrics["optim/loss"] = out.metrics["loss:sum"]
                metrics["optim/logprob_diff_max"] = max(
                    float((o["logprobs"].to_torch()[n:] - torch.tensor(lp)).abs().max())
                    for o, (n, lp) in zip(out.loss_fn_outputs, sampled)
                )
            last = step + 1 == config.max_steps
            if (step + 1) % config.eval_every == 0 or last:
                if not fresh:
                    sampler = training.save_weights_and_get_sampling_client(name=f"step_{step + 1}").result()
                    fresh = True
                metrics["test/pass_at_1"] = evaluate(sampler, renderer, test, config)
            if step == 0:
                metrics["test/start_pass_at_1"] = start
            logger.log(step=step, **metrics)  # as train_grpo logs: the row of step s, its evaluation after it
            bar.set_postfix(correct=f"{metrics['env/all/correct']:.2f}", refresh=False)
    png = save_curves(log_dir)
    print(f"held-out pass@1: {start:.1%} -> {metrics['test/pass_at_1']:.1%} ({config.num_eval} test problems, greedy)")
    print(f"metrics: {log_dir / 'metrics.jsonl'}\nlearning curves: {png}")
    return log_dir


PANELS = (
    ("env/all/correct", "train correct (sampled)"),
    ("test/pass_at_1", "held-out pass@1 (greedy)"),
    ("env/all/by_group/frac_mixed", "frac_mixed (groups with signal)"),
    ("optim/loss", "loss (Tinker's sum)"),
    ("optim/logprob_diff_max", "max |training - sampler| log-prob"),
    ("env/all/format", "format"),
)


def save_curves(log_dir: Path) -> Path:
    """The run's learning curves, next to its metrics.jsonl."""
    from edurl.plotting import plot_grpo_metrics

    return save_figure(
        plot_grpo_metrics(load_metrics(log_dir), panels=PANELS), log_dir / "learning_curves.png", dpi=110
    )


if __name__ == "__main__":
    run_as_script(main)
