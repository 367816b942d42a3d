"""Chapter 9's loop: a warm start on demonstrated episodes, then GRPO over whole episodes.

One GRPO step on a multi-turn game::

    1. sampler = trainer.save_weights_and_get_sampling_client()
    2. builders = batch_size EnvGroupBuilders (a secret, or a problem), group_size envs each
    3. groups = do_group_rollouts(builders, sampler, ...)        every waiting env in one batch per round
    4. advantage of an episode = its total reward - its group's mean (or per turn, with per_turn_credit)
    5. datums = one per episode (or one per turn when the renderer breaks the prefix), env tokens masked;
       with kl_coef > 0, each action token's advantage also gets Tinker's KL penalty to the warm start
    6. forward_backward(datums, loss_fn) + optim_step

The warm start (:func:`load_or_train_game_sft`) is supervised learning on demonstrated episodes, with weight 1
on every assistant turn, through the same ``TrainingClient`` (``loss_fn="cross_entropy"``), and is cached like
Chapter 6's. Evaluation (:func:`evaluate_game`) plays greedily: guess-the-number against every secret, the
calculator on held-out problems, with and without the tool.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pandas as pd

from edurl._checks import check_fields
from edurl.llm import losses as L
from edurl.llm.clients import AdamParams, SamplingClient, TrainingClient
from edurl.llm.datum import build_supervised_datum
from edurl.llm.distributed import refuse_under_torchrun
from edurl.llm.envs import base as E
from edurl.llm.envs.calculator import CalculatorGroupBuilder, direct_demonstration, tool_demonstration
from edurl.llm.envs.guess_number import GuessNumberGroupBuilder, check_reward_settings, demonstration
from edurl.llm.grpo import kl_into_advantages
from edurl.llm.loop import check_lora_rank, new_training_client, problem_seed
from edurl.llm.model import TinyLMConfig, build_tiny_lm
from edurl.llm.renderer import ChatMLRenderer, Message
from edurl.llm.sampling import SamplingParams
from edurl.llm.sft import cached_checkpoint, check_warmup, checkpoint_key, warmup_cosine
from edurl.llm.tasks import ArithmeticTask
from edurl.llm.tokenizer import build_char_tokenizer
from edurl.metrics import MetricsLogger, load_metrics
from edurl.utils import device as pick_device
from edurl.utils import progress, torch_threads, warn_at_caller

GAMES = ("guess_number", "calculator")
CALCULATOR_TASK = ArithmeticTask(num_digits=3, ops=("+",))
"""The calculator's hard problems: 3-digit addition, split by a hash as in Chapter 6."""
EASY_TASK = ArithmeticTask(num_digits=1, ops=("+",))
"""The calculator's easy problems (with ``easy_fraction`` > 0): 1-digit addition, which needs no tool."""
GUESS_RL_SETTINGS = dict(
    batch_size=8, group_size=8, learning_rate=3e-4, shaped=True, per_turn_credit=True, discount=0.0
)
"""The MultiTurnConfig settings under which guess-the-number learned in Chapter 9's recipe search: the shaped reward,
each turn credited with its own reward (discount 0), 8 secrets x 8 games a step, learning rate 3e-4."""
GAME_MODEL = TinyLMConfig(max_position_embeddings=256)
"""The course's tiny LM with room for a whole 5-guess game (about 220 tokens)."""


def conversation_example(renderer: ChatMLRenderer, messages: list[Message]) -> tuple[list[int], list[float]]:
    """Tokens of a whole conversation and a weight per token: 1 on every assistant reply (its ``<|im_end|>``
    included), 0 on everything else. Each reply sits where the renderer's prompt for that turn ends, so the
    renderer must have the prefix property; a renderer without it raises rather than mislabel tokens."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise ValueError("the conversation has no assistant reply to learn from")
    stop = renderer.get_stop_sequences()
    tokens = renderer.build_generation_prompt(messages[:last]) + renderer._encode(messages[last]["content"]) + stop
    weights = [0.0] * len(tokens)
    for i, m in enumerate(messages[: last + 1]):
        if m["role"] != "assistant":
            continue
        prompt = renderer.build_generation_prompt(messages[:i])
        reply = renderer._encode(m["content"]) + stop
        if not E.extends(prompt + reply, tokens):
            raise ValueError(
                f"the renderer's prompt for assistant turn {i} is not a prefix of the whole conversation, so its "
                "reply has no fixed position; use a renderer with the prefix property (see edurl.llm.envs.base)"
            )
        weights[len(prompt) : len(prompt) + len(reply)] = [1.0] * len(reply)
    return tokens, weights


# ---------------------------------------------------------------- the warm start


@dataclass
class GameSFTConfig:
    """The supervised warm start of a Chapter 9 game."""

    game: str = "guess_number"
    """guess_number (demonstrations: random guesses inside the remaining range) or calculator."""
    tool_fraction: float = 0.5
    """calculator: the share of demonstrations that call the tool; the rest answer directly. With easy_fraction > 0,
    the share of the easy problems' demonstrations; the 3-digit ones always call it."""
    easy_fraction: float = 0.0
    """calculator: the share of problems that are 1-digit sums (EASY_TASK); the rest are 3-digit sums. With easy
    problems in the mix, the demonstrator calls the tool on every 3-digit sum, as someone who cannot add them in
    their head would, and on a tool_fraction share of the 1-digit ones, where the tool is not needed: deciding
    when to call it there is left to RL."""
    model: TinyLMConfig = field(default_factory=lambda: GAME_MODEL)
    """The model's sizes."""
    max_steps: int = 500
    """Optimizer steps."""
    batch_size: int = 32
    """Demonstrated episodes per step."""
    learning_rate: float = 3e-3
    """Adam's peak learning rate (linear warm-up, then cosine decay to 10 %)."""
    warmup_steps: int = 50
    """Steps of linear warm-up."""
    seed: int = 0
    """Seeds the model's initialisation and the demonstrations."""
    num_threads: int = 2
    """torch CPU threads."""
    device: str | None = None
    """Where to train; None picks with edurl.device()."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            positive_int=("max_steps", "batch_size", "num_threads"),
            nonneg_int=("seed", "warmup_steps"),
            unit=("tool_fraction", "easy_fraction"),
            nonneg=("learning_rate",),
            choices={"game": GAMES},
        )
        check_warmup(self)
        calculator_only = {"tool_fraction": 0.5, "easy_fraction": 0.0}  # they changed the key, not the demonstrations
        unused = [
            n for n, default in calculator_only.items() if self.game != "calculator" and getattr(self, n) != default
        ]
        if unused:
            raise ValueError(
                f"{unused} shape the calculator's demonstrations and do nothing in {self.game!r} (but would cache the "
                f"same warm start again under another key); leave them at their defaults "
                f"({', '.join(f'{n}={calculator_only[n]!r}' for n in unused)}), or set game='calculator'"
            )

    def key(self) -> str:
        """A short hash of everything that determines the trained weights (the threads that actually train)."""
        fields = asdict(self)
        if fields["easy_fraction"] == 0.0:
            del fields["easy_fraction"]  # the keys of warm starts cached before the field existed stay the same
        return "game-" + checkpoint_key({"v": 1, "kind": "game_sft", **fields})

    def demonstrations(self, n: int, seed: int) -> list[list[Message]]:
        """``n`` demonstrated episodes, reproducible from ``seed``."""
        rng = random.Random(f"{self.game}-{seed}")
        if self.game == "guess_number":
            return [demonstration(rng.randrange(32), rng) for _ in range(n)]
        if self.easy_fraction == 0.0:
            problems = CALCULATOR_TASK.sample(n, split="train", seed=seed)
            return [
                tool_demonstration(p) if rng.random() < self.tool_fraction else direct_demonstration(p)
                for p in problems
            ]
        demos = []
        for problem, easy in calculator_problems(n, "train", seed, self.easy_fraction):
            calls = not easy or rng.random() < self.tool_fraction
            demos.append(tool_demonstration(problem) if calls else direct_demonstration(problem))
        return demos


def train_game_sft(config: GameSFTConfig, progress_bar: bool = True):
    """Train the warm start from scratch. Returns ``(model, tokenizer, history)``; history has one row per step."""
    tokenizer = build_char_tokenizer()
    renderer = ChatMLRenderer(tokenizer)
    dev = pick_device(config.device)
    history = []
    with torch_threads(config.num_threads, config.device):
        model = build_tiny_lm(tokenizer, config.model, seed=config.seed).to(dev)
        trainer = TrainingClient(model, tokenizer)
        episodes = config.demonstrations(config.max_steps * config.batch_size, config.seed)
        start = time.perf_counter()
        bar = progress(range(config.max_steps), desc=f"SFT ({config.game})", disable=not progress_bar)
        for step in bar:
            batch = episodes[step * config.batch_size : (step + 1) * config.batch_size]
            datums = [build_supervised_datum(*conversation_example(renderer, m)) for m in batch]
            out = trainer.forward_backward(datums, "cross_entropy", aggregation="token_mean").result()
            lr = warmup_cosine(config.learning_rate, step, config.max_steps, config.warmup_steps)
            trainer.optim_step(AdamParams(learning_rate=lr, grad_clip_norm=1.0)).result()
            history.append({"step": step, "loss": out.loss, "lr": lr, "time": time.perf_counter() - start})
            bar.set_postfix(loss=f"{out.loss:.3f}", refresh=False)
        bar.close()
    return trainer.model.eval(), tokenizer, history


def load_or_train_game_sft(config: GameSFTConfig | None = None, progress_bar: bool = True):
    """The warm start for ``config``: from the cache (``$EDURL_CACHE/sft``), or trained and cached.
    Returns ``(model, tokenizer, history, path)``."""
    config = config or GameSFTConfig()
    return cached_checkpoint(config.key(), config, lambda: train_game_sft(config, progress_bar), config.device)


# ---------------------------------------------------------------- evaluation


def calculator_problems(n: int, split: str, seed: int, easy_fraction: float = 0.0) -> list[tuple[object, bool]]:
    """``n`` calculator problems of ``split`` as ``(problem, is_easy)``: ``round(n * easy_fraction)`` 1-digit sums
    (EASY_TASK), the rest 3-digit sums (CALCULATOR_TASK), shuffled together, reproducible from ``seed``."""
    n_easy = round(n * easy_fraction)
    mixed = [(p, True) for p in EASY_TASK.sample(n_easy, split=split, seed=seed)]
    mixed += [(p, False) for p in CALCULATOR_TASK.sample(n - n_easy, split=split, seed=seed)]
    random.Random(f"calculator-mix-{seed}").shuffle(mixed)
    return mixed


def game_builders(
    game: str,
    renderer: ChatMLRenderer,
    n: int,
    seed: int,
    split: str,
    group_size: int,
    easy_fraction: float = 0.0,
    **env_kwargs,
):
    """``n`` group builders: random secrets for guess_number (every secret once, in order, for ``split="test"``
    when n is 32), ``split`` problems of the calculator task (a share ``easy_fraction`` of them 1-digit sums)."""
    if game == "guess_number":
        rng = random.Random(f"secrets-{seed}")
        secrets = list(range(32)) if split == "test" and n == 32 else [rng.randrange(32) for _ in range(n)]
        return [GuessNumberGroupBuilder(s, renderer, group_size, **env_kwargs) for s in secrets]
    if game == "calculator":
        problems = calculator_problems(n, split, seed, easy_fraction)
        return [CalculatorGroupBuilder(p, renderer, group_size, **env_kwargs) for p, _ in problems]
    raise ValueError(f"game must be one of {GAMES}, got {game!r}")


def evaluate_game(
    model,
    tokenizer,
    game: str,
    num_eval: int = 200,
    seed: int = 0,
    max_tokens: int = 24,
    temperature: float = 0.0,
    samples: int = 1,
    **env_kwargs,
) -> dict[str, float]:
    """Play ``samples`` episodes per secret or problem at ``temperature`` (0: greedy). guess_number: every secret
    0..31 (``num_eval`` is ignored), so greedy ``win`` is the greedy policy's exact win rate. calculator:
    ``num_eval`` held-out problems. Returns the rollout metrics without their ``env/all/`` prefix (``win``,
    ``guesses``, ``illegal``; or ``correct``, ``used_tool``, ...)."""
    renderer = ChatMLRenderer(tokenizer)
    n = 32 if game == "guess_number" else num_eval
    builders = game_builders(game, renderer, n, seed, "test", samples, **env_kwargs)
    sampler = SamplingClient(model, tokenizer)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=None if temperature == 0 else seed)
    groups = E.do_group_rollouts(builders, sampler, params, prefix_cache=True)
    return {k.removeprefix("env/all/"): v for k, v in E.rollout_metrics(groups).items() if "by_group" not in k}


# ---------------------------------------------------------------- GRPO on episodes


@dataclass
class MultiTurnConfig:
    """A GRPO run on a Chapter 9 game."""

    sft: GameSFTConfig = field(default_factory=GameSFTConfig)
    """The warm start; its game is the game played."""
    base_model: str | None = None
    """A model folder or hub id to play with instead of the warm start (e.g. a real chat model). ``sft`` then only
    names the game (and the calculator's ``easy_fraction``); nothing is trained before RL, so the model starts from
    whatever it makes of the game's prompts and replies (see Chapter 9, "A real model")."""
    lora_rank: int | None = None
    """None trains every weight; an int trains a peft LoRA adapter of that rank (seeded by ``seed``)."""
    group_size: int = 8
    """G: episodes per secret or problem."""
    batch_size: int = 16
    """Groups per step."""
    max_steps: int = 150
    """GRPO iterations."""
    learning_rate: float = 3e-4
    """Adam learning rate (constant)."""
    loss_fn: str = "importance_sampling"
    """importance_sampling, ppo, cispo or dro."""
    dro_beta: float = 0.05
    """beta of the dro loss (as GRPOConfig.dro_beta)."""
    aggregation: str = "seq_mean_token_mean"
    """How per-token losses become one number (see edurl.llm.losses.aggregate): sum, seq_mean_token_mean or
    token_mean. The default averages within each datum first, which is each episode when the renderer keeps the
    prefix property (env/all/merged_fraction = 1; with per-turn datums it is each turn, and the step warns), so a
    long episode (a lost game uses every guess) weighs no more in total than a short one; token_mean would let the
    longer losing games' negative advantages outweigh the winners' on the tokens every reply shares. Dr. GRPO's seq_mean_token_sum_norm is refused: it
    divides by a fixed token budget per sequence, and an episode's budget is not one turn's max_tokens."""
    temperature: float = 1.0
    """Sampling temperature of every turn."""
    max_tokens: int = 24
    """Most tokens per model turn."""
    guess_penalty: float = 0.0
    """guess_number: reward lost per guess (shaping toward short games)."""
    shaped: bool = False
    """guess_number: reward each guess by the share of numbers it rules out, instead of 1 for a win at the end."""
    win_bonus: float = 0.0
    """guess_number, with shaped: the extra reward of a win, on top of the share it ruled out (1.0 keeps the game's
    own reward; 0.0 pays for narrowing the range only, so a near miss earns almost as much as a win)."""
    relative: bool = False
    """guess_number, with shaped: pay each guess the share of the numbers still possible that it rules out, not the
    share of all of them (GuessNumberEnv), so that every turn is paid on the same scale."""
    scratchpad_bonus: float = 0.0
    """guess_number: reward added to each reply that begins with the right scratchpad (the range still possible and
    its middle): a process reward that keeps the game's state written correctly, where an outcome reward ignores it."""
    per_turn_credit: bool = False
    """Credit each turn with the reward from it to the episode's end, centred over the group at the same turn
    (TrajectoryGroup.turn_advantages); False: every turn gets its episode's centred total reward."""
    discount: float = 1.0
    """With per_turn_credit: the weight of a reward one turn later (0: each turn's own reward only)."""
    kl_coef: float = 0.0
    """Tinker's KL penalty to the warm start, put into each action token's advantage (edurl.llm.grpo.
    kl_into_advantages); 0: none. It holds the tokens the reward does not look at, such as guess-the-number's
    scratchpad, where the warm start put them: without it, noise in the advantages moves them freely. Unlike
    GRPOConfig, which keeps uniform groups by default, groups whose episodes all scored the same give no datums
    here (groups_to_datums), so the penalty acts only on the episodes of groups that differ."""
    tool_cost: float = 0.0
    """calculator: reward lost per tool call."""
    prefix_cache: bool = True
    """Keep each episode's keys and values between its turns, so that a turn runs only its new tokens through the
    model (edurl.llm.sampling.PrefixCache): the same draws up to rounding, about a third less sampling time on
    guess-the-number. False re-encodes the whole conversation every turn."""
    eval_every: int = 25
    """Steps between greedy evaluations (also at the start and the end)."""
    num_eval: int = 200
    """calculator: held-out problems per evaluation, 3-digit sums only whatever the warm start's easy_fraction
    (guess_number always plays all 32 secrets)."""
    seed: int = 0
    """Seeds the warm start, the secrets or problems, and the sampling."""
    num_threads: int = 2
    """torch CPU threads."""
    device: str | None = None
    """Where to train and sample; None picks with edurl.device()."""
    log_dir: str = "runs/multiturn"
    """Where metrics.jsonl goes."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        if not isinstance(self.sft, GameSFTConfig):  # sft="calculator" failed with "'str' object has no attribute"
            raise TypeError(
                f"sft must be a GameSFTConfig, got {type(self.sft).__name__} {self.sft!r}: pass e.g. "
                "sft=GameSFTConfig(game='calculator')"
            )
        check_fields(
            self,
            positive_int=("group_size", "batch_size", "max_steps", "max_tokens", "eval_every", "num_eval"),
            nonneg_int=("seed",),
            nonneg=(
                "learning_rate",
                "temperature",
                "guess_penalty",
                "tool_cost",
                "win_bonus",
                "kl_coef",
                "scratchpad_bonus",
                "dro_beta",
            ),
        )
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2: a group of one has advantage 0 after centring")
        check_lora_rank(self.lora_rank)
        if isinstance(self.base_model, os.PathLike):
            self.base_model = os.fspath(self.base_model)  # a pathlib.Path, as load_policy takes it
        if self.base_model is not None and (not isinstance(self.base_model, str) or not self.base_model):
            raise ValueError(
                f"base_model must be None (the game's warm start) or a model folder or hub id, got {self.base_model!r}"
            )
        L.get_loss_fn(self.loss_fn)  # names the known losses if this is not one
        if self.aggregation == "seq_mean_token_sum_norm":
            raise ValueError(
                "aggregation 'seq_mean_token_sum_norm' (Dr. GRPO) divides each episode's summed loss by a fixed "
                "token budget, and an episode of several turns has none here (max_tokens is one turn's); use "
                "'seq_mean_token_mean' (the default) or 'token_mean'"
            )
        if self.aggregation not in L.AGGREGATION_MODES:
            raise ValueError(f"aggregation must be one of {L.AGGREGATION_MODES}, got {self.aggregation!r}")
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0, got {self.temperature!r}: GRPO plays G episodes of each game and learns "
                "from how they differ, and greedy sampling (0) makes them all the same, so every group is uniform "
                "and nothing is learned. Held-out evaluation is greedy already."
            )
        if not 0 <= self.discount <= 1:
            raise ValueError(f"discount must be in [0, 1], got {self.discount!r}")
        if self.discount != 1 and not self.per_turn_credit:
            raise ValueError(
                f"discount={self.discount!r} weighs later turns' rewards in per-turn credit, and per_turn_credit is "
                "False (every turn gets its episode's total): set per_turn_credit=True, or leave discount at 1"
            )
        other_game = (
            {"tool_cost": 0.0}
            if self.sft.game == "guess_number"
            else {"guess_penalty": 0.0, "shaped": False, "win_bonus": 0.0, "relative": False, "scratchpad_bonus": 0.0}
        )
        unused = [name for name, default in other_game.items() if getattr(self, name) != default]
        if unused:
            raise ValueError(
                f"{unused} belong to the other game and do nothing in {self.sft.game!r}; leave them at their defaults "
                f"({', '.join(f'{n}={other_game[n]!r}' for n in unused)}), or set sft=GameSFTConfig(game=...) to "
                "the game they are for"
            )
        if self.win_bonus and not self.shaped:
            raise ValueError("win_bonus is added to the shaped reward; set shaped=True, or leave win_bonus at 0")
        if self.relative and not self.shaped:
            raise ValueError("relative changes the shaped reward; set shaped=True as well, or leave relative False")
        # the env's own checks, here so that a bad setting is refused before the warm start trains and the log_dir
        # is emptied, not at the first rollout
        if self.sft.game == "guess_number":
            check_reward_settings(**self.env_kwargs())
        elif not self.tool_cost < 1:
            raise ValueError(f"tool_cost must be in [0, 1), got {self.tool_cost!r}")
        if self.sft.seed not in (0, self.seed):
            raise ValueError(
                f"sft.seed={self.sft.seed} but seed={self.seed}: the run's seed also seeds its warm start (the "
                f"warm start of sft.seed would not be the one trained on), so set seed={self.sft.seed} here as "
                "well, or leave sft.seed at 0"
            )

    def loss_fn_config(self) -> dict:
        """The ``loss_fn_config`` of ``forward_backward``: dro's beta; the other losses take their defaults."""
        return {"beta": self.dro_beta} if self.loss_fn == "dro" else {}

    def env_kwargs(self) -> dict:
        if self.sft.game == "guess_number":
            return {
                "guess_penalty": self.guess_penalty,
                "shaped": self.shaped,
                "win_bonus": self.win_bonus,
                "relative": self.relative,
                "scratchpad_bonus": self.scratchpad_bonus,
            }
        return {"tool_cost": self.tool_cost, "easy_fraction": self.sft.easy_fraction}


@dataclass
class MultiTurnResult:
    config: MultiTurnConfig
    metrics: pd.DataFrame
    """One row per step (metrics.jsonl)."""
    trainer: TrainingClient
    start: dict[str, float]
    """Greedy evaluation of the warm start."""
    final: dict[str, float]
    """Greedy evaluation after the last step."""


def multiturn_step(config: MultiTurnConfig, trainer: TrainingClient, renderer: ChatMLRenderer, step: int) -> dict:
    """One GRPO iteration on whole episodes (steps 1-6 of the module docstring). Returns the metrics row."""
    t0 = time.perf_counter()
    sampler = trainer.save_weights_and_get_sampling_client(f"step_{step}")
    seed = problem_seed(config.seed, step)
    builders = game_builders(
        config.sft.game, renderer, config.batch_size, seed, "train", config.group_size, **config.env_kwargs()
    )
    params = SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, seed=seed)
    groups = E.do_group_rollouts(builders, sampler, params, prefix_cache=config.prefix_cache)
    t1 = time.perf_counter()
    datums, datum_row = E.groups_to_datums(groups, config.per_turn_credit, config.discount)
    if config.aggregation == "seq_mean_token_mean" and datum_row["env/all/merged_fraction"] < 1:
        warn_at_caller(
            "some episodes were not prefix-consistent and became one datum per turn, and aggregation "
            "'seq_mean_token_mean' averages over datums: such an episode weighs as many sequences as it has turns, "
            "where a merged one weighs one. aggregation='token_mean' or 'sum' gives both layouts the same gradient; "
            "env/all/merged_fraction logs the share that merged.",
        )
    row = {**E.rollout_metrics(groups), **datum_row}
    if datums and config.kl_coef > 0:
        datums, row["env/all/kl_sample_ref"] = kl_into_advantages(trainer, datums, config.kl_coef, config.temperature)
    if datums:
        out = trainer.forward_backward(
            datums,
            config.loss_fn,
            config.loss_fn_config(),
            aggregation=config.aggregation,
            temperature=config.temperature,
        ).result()
        opt = trainer.optim_step(AdamParams(learning_rate=config.learning_rate)).result()
        row.update({**out.metrics, **opt, "optim/loss": out.loss})
    row.update({"time/sample": t1 - t0, "time/train": time.perf_counter() - t1})
    return row


def train_multiturn(config: MultiTurnConfig | None = None) -> MultiTurnResult:
    """GRPO on the game of ``config.sft``; writes ``log_dir/metrics.jsonl``. See the module docstring."""
    config = config or MultiTurnConfig()
    refuse_under_torchrun("train_multiturn")  # before the warm start: every rank would train the whole run
    game = config.sft.game
    sft = replace(config.sft, seed=config.seed)  # the run's seed also seeds its warm start
    log_dir = Path(config.log_dir)
    with torch_threads(config.num_threads):
        device = pick_device(config.device)  # a misspelt device is named before the warm start trains
        if config.base_model is None:
            model, tokenizer, _, _ = load_or_train_game_sft(sft, progress_bar=config.progress)
            base = (model, tokenizer)
        else:
            base = config.base_model  # load_policy names a path that holds no model
        trainer = new_training_client(
            base,
            lora_rank=config.lora_rank,
            seed=config.seed,
            keep_reference=config.kl_coef > 0,
            device=device,
            log_dir=config.log_dir,
        )
        tokenizer = trainer.tokenizer
        renderer = ChatMLRenderer(tokenizer)

        def evaluate():
            return evaluate_game(trainer.model, tokenizer, game, config.num_eval, config.seed, config.max_tokens)

        start = evaluate()
        # closed also when a step raises or the cell is stopped: Windows cannot replace an open file
        with MetricsLogger(log_dir, if_exists="overwrite") as logger:
            (log_dir / "config.json").write_text(
                json.dumps({"run": "multiturn", **asdict(config)}, indent=1, default=str)
            )
            headline = "win" if game == "guess_number" else "correct"
            bar = progress(range(config.max_steps), desc=f"GRPO ({game})", disable=not config.progress)
            for step in bar:
                row = multiturn_step(config, trainer, renderer, step)
                if step == 0:
                    row.update({f"test/start_{k}": v for k, v in start.items()})
                if (step + 1) % config.eval_every == 0 or step + 1 == config.max_steps:
                    row.update({f"test/{k}": v for k, v in evaluate().items()})
                    bar.set_postfix({"test": f"{row[f'test/{headline}']:.2f}"}, refresh=False)
                logger.log(step, **row)
            bar.close()
        final = {k.removeprefix("test/"): v for k, v in row.items() if k.startswith("test/") and "start" not in k}
    return MultiTurnResult(config, load_metrics(log_dir), trainer, start, final)


__all__ = [
    "CALCULATOR_TASK",
    "EASY_TASK",
    "GAMES",
    "GUESS_RL_SETTINGS",
    "GameSFTConfig",
    "MultiTurnConfig",
    "MultiTurnResult",
    "calculator_problems",
    "conversation_example",
    "evaluate_game",
    "game_builders",
    "load_or_train_game_sft",
    "multiturn_step",
    "train_game_sft",
    "train_multiturn",
]
