"""Learning from preferences: simulated raters, the Bradley-Terry reward model, and DPO (Chapter 8).

RLHF replaces Chapter 7's verifier with a reward *learned* from comparisons. This file holds the whole
pipeline, read downwards:

1. **Raters.** A hidden *gold* score defines what people prefer on the arithmetic task: a reply's manner (a
   full sentence is liked, padding is not) and, less, how close its boxed answer is to the truth. A rater
   compares two replies and prefers ``a`` with probability ``sigmoid((s(a) - s(b)) / temperature)``: the
   Bradley-Terry model (Bradley and Terry, 1952), which is how InstructGPT and its successors model a labeller.
   Because the probabilities are known, the best pair accuracy any reward model can reach on given pairs, the
   *ceiling*, is computed exactly: ``mean(max(p, 1 - p))``. A *biased* rater also likes longer replies; its
   preferences are the data of the over-optimisation experiment.
2. **Losses** (pure functions, the public contract): :func:`bradley_terry_loss` and :func:`dpo_loss`, and the
   classic KL-shaped RLHF reward, :func:`kl_shaped_rewards`.
3. **Pairs**: :func:`sample_pairs` (two replies of the SFT policy, labelled by a rater), :func:`preference_data`,
   and the control :func:`length_preference_data`, whose preference is visible in the reply itself.
4. **The reward model**: a ``*ForSequenceClassification`` head on the SFT weights (:func:`load_reward_model`),
   trained by :func:`train_reward_model` with the loop that DPO shares (:func:`train_on_pairs`);
   :class:`RewardModelReward` makes it the reward of Chapter 7's loop (``train_grpo(config, reward_fn=...)``).
5. **DPO**: :func:`train_dpo`, and its implicit reward judged like a reward model (:func:`dpo_metrics`).

Shapes: every per-pair tensor is ``(B,)``, one entry per pair.

    pair      prompt  chosen  rejected      the rater preferred chosen (the label is the order)
    rewards   r_c     r_r                   a reward model's scalar for each reply
    BT loss   mean -log sigmoid(r_c - r_r)
    DPO loss  mean -log sigmoid(beta * ((log pi_c - log ref_c) - (log pi_r - log ref_r)))
"""

from __future__ import annotations

import math
import numbers
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from edurl._checks import check_fields, check_same_shape, check_tensor
from edurl.llm.rewards import extract_boxed, is_integer_answer
from edurl.llm.sft import SFTConfig
from edurl.llm.tasks import FILLER
from edurl.utils import device as pick_device
from edurl.utils import progress as progress_bar
from edurl.utils import torch_threads

# ---------------------------------------------------------------- raters

UNPARSEABLE_SCORE = -4.0
"""Gold score of a reply with no integer in a ``\\boxed{}``. A boxed integer can score as low or lower: by a
miss (with no opening and no fillers, of more than about 6e5, ``e^(4 / 0.3) - 1``; with three fillers, of about
4e3), or by fillers alone (each costs 0.5, so a right answer with 8 of them scores -4 too)."""


GOLD_OPENING = "The answer is "
"""The opening the simulated people like: a reply that starts with it gets :data:`GOLD_OPENING_BONUS`."""
GOLD_OPENING_BONUS = 1.0
GOLD_FILLER_PENALTY = 0.5
"""Gold score lost per :data:`edurl.llm.tasks.FILLER` in a reply: people dislike padding."""
GOLD_ACCURACY_WEIGHT = 0.3
"""Weight of the answer's closeness, ``-log(1 + |error|)``, in the gold score."""


def gold_score(reply: str, answer: str) -> float:
    """What the simulated people want, a hidden score the reward model never sees::

        GOLD_OPENING_BONUS  * (reply starts with "The answer is ")     +1.0
      - GOLD_FILLER_PENALTY * (number of " ok" fillers)                 -0.5 each
      - GOLD_ACCURACY_WEIGHT * log(1 + |given - answer|)               0 when right, -0.21 off by one, -0.72 off by 10

    and :data:`UNPARSEABLE_SCORE` for a reply with no boxed integer. People judge manner at a glance and check
    the sum only roughly: a near miss beats a wild guess, so pairs of two wrong replies still carry information.
    The manner is visible in the reply; closeness needs arithmetic, which a reward model learns poorly from a
    thousand pairs (``benchmarks/reward_model_learnability.py``)."""
    given = extract_boxed(reply)
    if given is None or not is_integer_answer(given) or not is_integer_answer(str(answer).strip()):
        return UNPARSEABLE_SCORE
    manner = GOLD_OPENING_BONUS * reply.startswith(GOLD_OPENING) - GOLD_FILLER_PENALTY * reply.count(FILLER)
    return manner - GOLD_ACCURACY_WEIGHT * _log1p_miss(given, str(answer).strip())


def _log1p_miss(given: str, answer: str) -> float:
    """log(1 + |given - answer|) for integer strings, also for a reply's number too long for a float (or for
    ``int``'s 4300-digit limit): past 300 digits, log(10) per digit, which is that log to well under 1 %."""
    if max(len(given), len(answer)) <= 300:
        return math.log1p(abs(int(given) - int(answer)))
    return math.log(10) * max(len(given.lstrip("+-")), len(answer.lstrip("+-")))


def rlhf_sft_config(**overrides) -> SFTConfig:
    """Chapter 8's warm start: Chapter 6's tiny LM trained on *styled* demonstrations (an opening and 0-3
    fillers drawn per problem, :class:`edurl.llm.tasks.StyledProblem`) for 600 steps with no early stop, so its
    replies vary in manner as well as in the answer. Cached like Chapter 6's; ``overrides`` set other fields."""
    return SFTConfig(**{"styled": True, "target_pass_at_1": None, "max_steps": 600, **overrides})


@dataclass(frozen=True)
class Rater:
    """A simulated labeller: Bradley-Terry preferences on a score.

    ``score = gold_score + length_bonus * len(reply)``; ``length_bonus = 0`` is the gold rater, > 0 the biased
    one that also likes longer replies."""

    temperature: float = 0.5
    """Noise of the comparisons: P(a preferred) = sigmoid((s(a) - s(b)) / temperature)."""
    length_bonus: float = 0.0
    """Score added per character of the reply (0: the gold rater)."""

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if not (self.length_bonus >= 0 and math.isfinite(self.length_bonus)):
            raise ValueError(f"length_bonus must be a finite number >= 0, got {self.length_bonus!r}")

    def score(self, reply: str, answer: str) -> float:
        """The rater's hidden score of one reply."""
        return gold_score(reply, answer) + self.length_bonus * len(reply)

    def prefer_probability(self, reply_a: str, reply_b: str, answer: str) -> float:
        """P(the rater prefers ``reply_a`` to ``reply_b``)."""
        z = (self.score(reply_a, answer) - self.score(reply_b, answer)) / self.temperature
        if z < -700:  # exp(-z) would overflow; the sigmoid is exp(z) to the last bit there
            return math.exp(z)
        return 1.0 / (1.0 + math.exp(-z))


def ceiling(prefer_probabilities: torch.Tensor | Sequence[float]) -> float:
    """The best expected pair accuracy on pairs whose preference probabilities are given: a predictor that
    knows each probability ``p`` picks the likelier reply and is right with probability ``max(p, 1 - p)``.
    By hand: ``ceiling([0.9, 0.5, 0.2]) = (0.9 + 0.5 + 0.8) / 3 = 0.7333``."""
    p = torch.as_tensor(prefer_probabilities, dtype=torch.float64)
    if p.numel() == 0 or ((p < 0) | (p > 1) | p.isnan()).any():
        raise ValueError("prefer_probabilities must be a non-empty list of probabilities in [0, 1]")
    return float(torch.maximum(p, 1 - p).mean())


# ---------------------------------------------------------------- losses


def _check_pairs(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    check_tensor(a, name_a, ndim=(1,), floating=True)
    check_tensor(b, name_b, ndim=(1,), floating=True)
    check_same_shape(a, b, name_a, name_b)
    if a.numel() == 0:
        raise ValueError(f"{name_a} and {name_b} are empty: a mean over no pairs is NaN; pass at least one pair")


def _check_beta(beta) -> float:
    """DPO's beta as a float: a finite real number > 0 (NumPy's scalars too)."""
    if (
        isinstance(beta, (bool, np.bool_))
        or not isinstance(beta, numbers.Real)
        or not (beta > 0 and math.isfinite(beta))
    ):
        raise ValueError(f"beta must be a finite number > 0 (DPO's KL strength, e.g. 0.1), got {beta!r}")
    return float(beta)


def _check_rows(prompts, replies) -> None:
    if len(prompts) != len(replies):
        raise ValueError(
            f"got {len(prompts)} prompts and {len(replies)} replies: pass one prompt per reply (repeat a pair's "
            "prompt for its chosen and its rejected reply)"
        )


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """``mean(-log sigmoid(r_c - r_r))`` over pairs: the negative log-likelihood of the labels under
    Bradley-Terry. Inputs ``(B,)``, a scalar out. ``logsigmoid`` keeps it finite for any margin.

    By hand: equal rewards give ``log 2 = 0.6931``; a margin of ``log 3`` gives ``-log(3/4) = 0.2877``."""
    _check_pairs(chosen_rewards, rejected_rewards, "chosen_rewards", "rejected_rewards")
    return -F.logsigmoid(chosen_rewards - rejected_rewards).mean()


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """DPO (Rafailov et al., 2023): Bradley-Terry on the implicit reward ``beta * (log pi - log ref)``.

    ``mean(-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))))`` with summed sequence log-probs of shape
    ``(B,)``; a scalar out. At ``pi = ref`` it is ``log 2`` whatever ``beta``."""
    for name, value in (("policy_rejected_logps", policy_rejected_logps), ("ref_chosen_logps", ref_chosen_logps)):
        _check_pairs(policy_chosen_logps, value, "policy_chosen_logps", name)
    _check_pairs(policy_chosen_logps, ref_rejected_logps, "policy_chosen_logps", "ref_rejected_logps")
    beta = _check_beta(beta)
    chosen = policy_chosen_logps - ref_chosen_logps  # (B,): log pi/ref of the chosen reply
    rejected = policy_rejected_logps - ref_rejected_logps  # (B,)
    return -F.logsigmoid(beta * (chosen - rejected)).mean()


def implicit_rewards(policy_logps: torch.Tensor, ref_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's implicit reward of each reply, ``beta * (log pi - log ref)``: ``(B,)``."""
    _check_pairs(policy_logps, ref_logps, "policy_logps", "ref_logps")
    return _check_beta(beta) * (policy_logps - ref_logps)


def kl_shaped_rewards(
    rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """The classic RLHF reward (Ziegler et al., 2019; InstructGPT): the reward model's score minus
    ``kl_coef`` times the sampled reply's log-ratio to the reference policy, summed over its tokens.

    ====================  ==========  =====================================================
    argument              shape       meaning
    ====================  ==========  =====================================================
    rewards               (B,)        the reward model's score of each reply
    logprobs              (B, T)      the sampling policy's log-prob of each reply token
    ref_logprobs          (B, T)      the reference (SFT) policy's log-prob of the same tokens
    mask                  (B, T)      1 on the reply's tokens, 0 on prompt and padding
    ====================  ==========  =====================================================

    Returns ``rewards - kl_coef * sum_t mask * (logprobs - ref_logprobs)``, shape ``(B,)``: the sum is the
    single-sample (k1) estimate of KL(pi || ref) for that reply. By hand: reward 1, two reply tokens with
    log-ratios 0.5 and 0.25, ``kl_coef = 0.4``: ``1 - 0.4 * 0.75 = 0.7``.
    """
    check_tensor(rewards, "rewards", ndim=(1,), floating=True)
    for name, value in (("logprobs", logprobs), ("ref_logprobs", ref_logprobs)):
        check_tensor(value, name, ndim=(2,), floating=True)
    check_same_shape(logprobs, ref_logprobs, "logprobs", "ref_logprobs")
    check_same_shape(logprobs, mask, "logprobs", "mask")
    if logprobs.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"rewards has {rewards.shape[0]} replies but logprobs has {logprobs.shape[0]} rows; one reward per reply"
        )
    if not (kl_coef >= 0 and math.isfinite(kl_coef)):
        raise ValueError(f"kl_coef must be a finite number >= 0 (0: no penalty), got {kl_coef!r}")
    keep = mask != 0
    log_ratio = torch.where(keep, logprobs - ref_logprobs, torch.zeros_like(logprobs))  # (B, T)
    return rewards - kl_coef * log_ratio.sum(dim=1)


# ---------------------------------------------------------------- pairs


@dataclass(frozen=True)
class PreferencePair:
    """Two replies to one prompt and a rater's verdict on them."""

    prompt: tuple[int, ...]
    """The rendered generation prompt's token ids."""
    reply_a: tuple[int, ...]
    """The first reply's token ids (ending with the stop token when it stopped)."""
    reply_b: tuple[int, ...]
    """The second reply's token ids."""
    text_a: str
    """The first reply's text, as the rater read it."""
    text_b: str
    """The second reply's text."""
    answer: str
    """The problem's reference answer (for the gold score; never shown to a reward model)."""
    p_a: float
    """The rater's probability of preferring reply a: known exactly, so the ceiling is too."""
    a_preferred: bool
    """The label: drawn once from Bernoulli(p_a)."""

    @property
    def chosen(self) -> tuple[int, ...]:
        return self.reply_a if self.a_preferred else self.reply_b

    @property
    def rejected(self) -> tuple[int, ...]:
        return self.reply_b if self.a_preferred else self.reply_a

    @property
    def p_chosen(self) -> float:
        """The rater's probability of the label it gave."""
        return self.p_a if self.a_preferred else 1.0 - self.p_a


@torch.no_grad()
def sample_pairs(
    model,
    renderer,
    problems: Sequence,
    rater: Rater,
    seed: int = 0,
    temperature: float = 1.0,
    max_tokens: int = 16,
    samples_per_problem: int = 4,
) -> list[PreferencePair]:
    """Sample ``samples_per_problem`` replies per problem from ``model``, keep the first two whose texts
    differ (a problem whose replies all agree gives no pair), and let ``rater`` label them."""
    from edurl.llm.sampling import SamplingParams, sample

    if samples_per_problem < 2:
        raise ValueError(f"samples_per_problem must be >= 2 to form a pair, got {samples_per_problem}")
    prompts = [renderer.build_generation_prompt(p.messages()) for p in problems]
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, stop=renderer.get_stop_sequences(), seed=seed
    )
    completions = sample(model, prompts, samples_per_problem, params, pad_token_id=renderer.tokenizer.pad_token_id)
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for i, problem in enumerate(problems):
        group = completions[i * samples_per_problem : (i + 1) * samples_per_problem]
        texts = [renderer.parse_response(c.tokens, c.stop_reason)[0]["content"] for c in group]
        j = next((j for j in range(1, len(group)) if texts[j] != texts[0]), None)
        if j is None:
            continue
        p_a = rater.prefer_probability(texts[0], texts[j], problem.answer)
        pairs.append(
            PreferencePair(
                prompt=tuple(prompts[i]),
                reply_a=tuple(group[0].tokens),
                reply_b=tuple(group[j].tokens),
                text_a=texts[0],
                text_b=texts[j],
                answer=problem.answer,
                p_a=p_a,
                a_preferred=bool(torch.rand((), generator=generator, dtype=torch.float64) < p_a),
            )
        )
    return pairs


def relabel(pairs: Sequence[PreferencePair], rater: Rater, seed: int = 0) -> list[PreferencePair]:
    """The same replies, labelled afresh by ``rater``: new preference probabilities and new labels drawn from
    them. Two raters' data sets then differ only in their verdicts, never in the replies."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for p in pairs:
        p_a = rater.prefer_probability(p.text_a, p.text_b, p.answer)
        a_preferred = bool(torch.rand((), generator=generator, dtype=torch.float64) < p_a)
        out.append(replace(p, p_a=p_a, a_preferred=a_preferred))
    return out


def length_pairs(renderer, problems: Sequence, rater: Rater, seed: int = 0, max_chars: int = 8) -> list[PreferencePair]:
    """One synthetic pair per problem whose two replies differ only in length (1 to ``max_chars`` x's, no answer),
    labelled by ``rater`` (give it a ``length_bonus``): a preference a reward model can read off the reply itself.
    A control for the pipeline: a reward model that cannot learn these has a bug, not a hard task."""
    if max_chars < 2:
        raise ValueError(f"max_chars must be >= 2 so that two replies can differ, got {max_chars}")
    rng = random.Random(seed)
    stop = list(renderer.get_stop_sequences())
    encode = lambda text: tuple(renderer.tokenizer.encode(text, add_special_tokens=False) + stop)  # noqa: E731
    pairs = []
    for problem in problems:
        prompt = tuple(renderer.build_generation_prompt(problem.messages()))
        text_a, text_b = ("x" * k for k in rng.sample(range(1, max_chars + 1), 2))
        p_a = rater.prefer_probability(text_a, text_b, problem.answer)
        a_preferred = rng.random() < p_a
        pairs.append(
            PreferencePair(prompt, encode(text_a), encode(text_b), text_a, text_b, problem.answer, p_a, a_preferred)
        )
    return pairs


# ---------------------------------------------------------------- the reward model


def load_reward_model(path, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A sequence-classification model with one scalar output (``AutoModelForSequenceClassification``,
    ``num_labels=1``) on the weights of the causal LM at ``path``: its transformer is the LM's, and only the
    scalar head ``score`` is new (initialised from ``seed``). Works for the course's SFT checkpoint and for any
    local Hugging Face folder, e.g. Qwen2.5-0.5B-Instruct's.

    ``dtype`` is float32 whatever the checkpoint stores (Qwen2.5 stores bfloat16): the reward model is trained
    with AdamW on its own weights, and in bfloat16 a step smaller than half the gap between neighbouring values
    is rounded away (:func:`train_on_pairs` refuses 16-bit weights).

    The head reads each row's last token before the padding, so the pad id must be one no reply ends with. A
    checkpoint that pads with one of its stop tokens (Qwen2.5-Instruct pads with ``<|endoftext|>``, on which its
    generation config stops) pads with its first spare embedding row, ``len(tokenizer)``, instead; without a
    spare row it is refused."""
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the load report lists the new head, which is expected
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)
    finally:
        transformers.logging.set_verbosity(verbosity)
    # a tokenizer only when the folder has one: else transformers may build a default, unrelated one
    has_tokenizer = any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    saved = _saved_generation_config(path)
    if model.config.pad_token_id is None:  # Qwen2.5's config.json has none: its pad is in generation_config.json
        model.config.pad_token_id = _saved_pad_id(saved, tokenizer)
    if model.config.pad_token_id is None:
        raise ValueError(
            f"the model at {path} has no pad id in its config, its generation_config or its tokenizer; the reward "
            "model needs one to find each sequence's last token. Set config.pad_token_id to a token that no reply "
            "ends with (not <|im_end|>) and save again."
        )
    stops = _saved_stop_ids(saved, model, tokenizer)
    pad = model.config.pad_token_id
    if pad in stops:
        # the head reads each row's last non-pad token, so a reply that ends on its pad id is scored at the token
        # before: Qwen2.5-Instruct pads with <|endoftext|>, one of the ids its generation config (and sample())
        # stops on, and a reply that ended there scored as if it were cut off. Pad with a spare embedding row
        # (real checkpoints have more rows than their tokenizer has tokens): an id with no token, which a reply
        # holds only if the policy put probability on it (parse_response warns then)
        spare = len(tokenizer) if tokenizer is not None else None
        if spare is not None and spare < model.get_input_embeddings().num_embeddings:
            model.config.pad_token_id = spare
        else:
            name = tokenizer.convert_ids_to_tokens(pad) if tokenizer is not None else None
            raise ValueError(
                f"the model at {path} pads with {name or 'id'} (id {pad}), a token replies end with (an end of turn "
                "or of sequence that sampling stops on): the head reads each row's last non-pad token, so it would "
                "skip the stop token, and an empty reply would be scored at another position with shared prompts "
                "than without. Set config.pad_token_id to a token that no reply ends with and save again."
            )
    return model


def _saved_generation_config(path):
    """The checkpoint's ``generation_config.json`` at ``path``, or None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return None


def _saved_stop_ids(generation_config, model, tokenizer) -> set[int]:
    """The ids a reply may end on: ``<|im_end|>`` and the checkpoint's end-of-sequence ids (its config's and its
    generation config's ``eos_token_id``, which :func:`~edurl.llm.sampling.sample` stops on)."""
    ids = []
    if tokenizer is not None and "<|im_end|>" in tokenizer.get_vocab():
        ids.append(tokenizer.get_vocab()["<|im_end|>"])
    declared = [model.config.eos_token_id, generation_config.eos_token_id if generation_config is not None else None]
    for eos in declared:
        ids += [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return {int(i) for i in ids}


def _saved_pad_id(generation_config, tokenizer) -> int | None:
    """The checkpoint's pad id from its generation config, else from its tokenizer (if any)."""
    pad = generation_config.pad_token_id if generation_config is not None else None
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    if pad is None and tokenizer is not None:
        pad = tokenizer.pad_token_id
    return pad


def score_sequences(
    reward_model, prompts: Sequence[Sequence[int]], replies: Sequence[Sequence[int]], share_prompts: bool = True
) -> torch.Tensor:
    """The reward model's scalar for each ``prompt + reply``: shape ``(B,)``, with gradient.

    Rows are right-padded with the model's pad id; the classification head reads the last non-pad token
    (the reply's stop token), as transformers' ``*ForSequenceClassification`` models do. A pair's two replies
    (and RL's G completions) share their prompt; with ``share_prompts``, when at most half the rows have distinct
    prompts, each prompt runs once and its replies read its KV cache (:mod:`edurl.llm.shared_prefix`): the same
    scores and gradients as whole rows (a test checks both)."""
    from edurl.llm.padding import pad
    from edurl.llm.shared_prefix import run_continuations, run_prompts

    _check_rows(prompts, replies)

    pad_id = reward_model.config.pad_token_id
    distinct: dict[tuple[int, ...], int] = {}
    u = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    shareable = isinstance(reward_model, PreTrainedModel) and all(len(r) > 0 for r in replies)  # has a KV cache
    if share_prompts and shareable and 2 * len(distinct) <= len(u):
        dev = reward_model.device
        prefix = run_prompts(reward_model, list(distinct), pad_id, reward_model.config, dev)
        if prefix is not None:
            rest_ids, rest_mask = pad([list(r) for r in replies], pad_id, device=dev)  # (B, Lr)
            out = run_continuations(reward_model, prefix, torch.tensor(u, device=dev), rest_ids, rest_mask)
            return _at_least_float32(out.logits.squeeze(-1))  # (B,): the head read each reply's last non-pad token
    rows = [list(p) + list(r) for p, r in zip(prompts, replies)]
    ids, mask = pad(rows, pad_id, device=reward_model.device)
    return _at_least_float32(reward_model(input_ids=ids, attention_mask=mask).logits.squeeze(-1))  # (B,)


def _at_least_float32(scores: torch.Tensor) -> torch.Tensor:
    """A 16-bit model's scores raised to float32; a float64 model's kept in float64."""
    return scores.to(torch.promote_types(scores.dtype, torch.float32))


@torch.no_grad()
def pair_metrics(reward_model, pairs: Sequence[PreferencePair], batch_size: int = 256) -> dict[str, float]:
    """How well a reward model agrees with the raters on ``pairs``.

    * ``accuracy``: share of pairs where the chosen reply scores higher (ties count half), against the
      sampled labels;
    * ``expected_accuracy``: the same against the rater's probabilities, ``mean(p_a if r_a > r_b else
      1 - p_a)``, free of label noise and directly comparable with
    * ``ceiling``: the best expected accuracy (:func:`ceiling`);
    * ``margin``: mean of ``r_chosen - r_rejected``; ``loss``: the Bradley-Terry loss.
    """
    if not pairs:
        raise ValueError("pairs is empty")
    was_training = reward_model.training
    reward_model.eval()
    r_a, r_b = [], []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        prompts = [p.prompt for p in chunk]
        both = score_sequences(reward_model, prompts + prompts, [p.reply_a for p in chunk] + [p.reply_b for p in chunk])
        r_a.append(both[: len(chunk)].cpu())  # one call for both replies, so each pair's prompt runs once
        r_b.append(both[len(chunk) :].cpu())
    reward_model.train(was_training)
    return _rank_metrics(torch.cat(r_a).double(), torch.cat(r_b).double(), pairs)


def _rank_metrics(r_a: torch.Tensor, r_b: torch.Tensor, pairs: Sequence[PreferencePair]) -> dict[str, float]:
    """:func:`pair_metrics` from the scores ``r_a``, ``r_b`` (B,) of each pair's two replies."""
    p_a = torch.tensor([p.p_a for p in pairs], dtype=torch.float64)
    a_preferred = torch.tensor([p.a_preferred for p in pairs])
    sign = torch.where(a_preferred, 1.0, -1.0).double()
    margin = sign * (r_a - r_b)  # (B,): r_chosen - r_rejected
    picks_a = torch.where(r_a > r_b, 1.0, torch.where(r_a < r_b, 0.0, 0.5)).double()
    return {
        "accuracy": float(torch.where(margin > 0, 1.0, torch.where(margin < 0, 0.0, 0.5)).mean()),
        "expected_accuracy": float((picks_a * p_a + (1 - picks_a) * (1 - p_a)).mean()),
        "ceiling": ceiling(p_a),
        "margin": float(margin.mean()),
        "loss": float(bradley_terry_loss(margin, torch.zeros_like(margin))),
    }


@dataclass
class PairTrainingConfig:
    """How the reward model and DPO train on pairs (:func:`train_on_pairs`): the fields they share."""

    batch_size: int = 64
    """Pairs per optimizer step."""
    epochs: int = 3
    """Passes over the training pairs."""
    learning_rate: float = 3e-4
    """AdamW learning rate (constant)."""
    eval_every: int = 20
    """Steps between held-out evaluations (also at the start and the end)."""
    seed: int = 0
    """Seeds the batch order (and, in RewardModelConfig, the problems, replies, labels and head)."""
    num_threads: int = 2
    """torch CPU threads."""
    device: str | None = None
    """Where the model trains; None picks with edurl.device()."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        check_fields(
            self, positive_int=("batch_size", "epochs", "eval_every"), positive=("learning_rate",), nonneg_int=("seed",)
        )


@dataclass
class RewardModelConfig(PairTrainingConfig):
    """Pairs from the SFT policy, labelled by a simulated rater, and a Bradley-Terry reward model on them."""

    sft: SFTConfig = field(default_factory=SFTConfig)
    """The policy that writes the replies (Chapter 6's warm start, cached); its weights also start the RM."""
    rater_temperature: float = 0.5
    """The rater's noise: P(a preferred) = sigmoid((s(a) - s(b)) / rater_temperature)."""
    length_bonus: float = 0.0
    """0: the gold rater; > 0: a rater that also likes longer replies, by this much per character."""
    num_train_problems: int = 2048
    """Training problems; each gives a pair unless all its sampled replies agree."""
    num_test_problems: int = 512
    """Held-out problems (the test split) for the pair accuracy."""
    sample_temperature: float = 1.0
    """Temperature of the policy that writes the replies: higher, more varied pairs."""
    max_tokens: int = 40
    """Most tokens per sampled reply (room for an opening, the answer and three fillers)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            positive_int=("num_train_problems", "num_test_problems", "max_tokens"),
            positive=("rater_temperature", "sample_temperature"),
            nonneg=("length_bonus",),
        )

    def rater(self) -> Rater:
        return Rater(temperature=self.rater_temperature, length_bonus=self.length_bonus)


@dataclass
class RewardModelResult:
    """A trained reward model, the data it saw, and its learning curve."""

    model: torch.nn.Module
    tokenizer: object
    history: list[dict]
    """One row per evaluation: step, train loss, and :func:`pair_metrics` on the held-out pairs (``test/...``)."""
    train_pairs: list[PreferencePair]
    test_pairs: list[PreferencePair]

    @property
    def final(self) -> dict[str, float]:
        return self.history[-1]


def train_on_pairs(
    model: torch.nn.Module, pairs: Sequence[PreferencePair], loss_on, evaluate, config: PairTrainingConfig, desc: str
) -> list[dict]:
    """The loop that the reward model and DPO share: ``config.epochs`` shuffled passes over ``pairs`` in batches,
    ``loss_on(batch)`` minimised with AdamW (constant learning rate, no weight decay, gradient norm clipped at 1),
    and ``evaluate() -> dict`` at the start, every ``config.eval_every`` steps and at the end.

    Returns the history: one row per evaluation with ``step``, ``train/loss`` (the last batch's), ``time/train``
    (seconds spent in training steps so far, evaluations excluded) and ``evaluate()``'s keys."""
    batch_size = config.batch_size
    params = [p for p in model.parameters() if p.requires_grad]
    low = sorted({str(p.dtype).removeprefix("torch.") for p in params if p.dtype in (torch.bfloat16, torch.float16)})
    if low:
        raise ValueError(
            f"the model's trainable weights are stored in {' and '.join(low)}, where AdamW's small steps round away "
            "(a step under half the gap between neighbouring values changes nothing). Load it in float32: "
            "load_reward_model(path) does by default, or from_pretrained(path, dtype=torch.float32), or "
            "model.float()."
        )
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    generator = torch.Generator().manual_seed(config.seed)
    total = config.epochs * math.ceil(len(pairs) / batch_size)
    history = [{"step": 0, "train/loss": float("nan"), "time/train": 0.0, **evaluate()}]
    bar = progress_bar(total=total, desc=desc, disable=not config.progress)
    step, seconds = 0, 0.0
    for _ in range(config.epochs):
        order = torch.randperm(len(pairs), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            t0 = time.perf_counter()
            model.train()
            loss = loss_on([pairs[i] for i in order[start : start + batch_size]])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            seconds += time.perf_counter() - t0
            step += 1
            bar.update(1)
            if step % config.eval_every == 0 or step == total:
                history.append({"step": step, "train/loss": loss.item(), "time/train": seconds, **evaluate()})
                if "test/expected_accuracy" in history[-1]:  # evaluate() may report other keys
                    bar.set_postfix(test_acc=f"{history[-1]['test/expected_accuracy']:.3f}", refresh=False)
    bar.close()
    model.eval()
    return history


def fit_reward_model(
    reward_model,
    train_pairs: Sequence[PreferencePair],
    test_pairs: Sequence[PreferencePair],
    *,
    batch_size: int = 64,
    epochs: int = 3,
    learning_rate: float = 3e-4,
    eval_every: int = 20,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Minimise :func:`bradley_terry_loss` over ``train_pairs`` with AdamW; evaluate on ``test_pairs``.
    Returns the history (see :class:`RewardModelResult`)."""
    if not train_pairs or not test_pairs:
        raise ValueError(
            f"need training and held-out pairs, got {len(train_pairs)} and {len(test_pairs)}; a problem gives no "
            "pair when all its sampled replies agree, so raise the problem counts or the sampling temperature"
        )

    def loss_on(batch: list[PreferencePair]) -> torch.Tensor:
        prompts = [p.prompt for p in batch]
        r = score_sequences(reward_model, prompts + prompts, [p.chosen for p in batch] + [p.rejected for p in batch])
        return bradley_terry_loss(r[: len(batch)], r[len(batch) :])  # one forward for both halves

    evaluate = lambda: _prefixed(pair_metrics(reward_model, test_pairs))  # noqa: E731
    config = PairTrainingConfig(
        batch_size=batch_size,
        epochs=epochs,
        learning_rate=learning_rate,
        eval_every=eval_every,
        seed=seed,
        progress=progress,
    )
    return train_on_pairs(reward_model, train_pairs, loss_on, evaluate, config, "reward model")


def _prefixed(metrics: dict[str, float]) -> dict[str, float]:
    return {f"test/{k}": v for k, v in metrics.items()}


@dataclass
class PreferenceData:
    """The SFT policy and the labelled pairs it wrote: what the reward model and DPO both learn from."""

    policy: torch.nn.Module
    """The SFT policy (Chapter 6's cached warm start) that wrote the replies."""
    tokenizer: object
    path: str
    """The SFT checkpoint's folder: the reward model and DPO's policy and reference start from it."""
    rater: Rater
    train_pairs: list[PreferencePair]
    test_pairs: list[PreferencePair]
    """Pairs on held-out (test-split) problems."""

    def relabel(self, rater: Rater, seed: int = 0) -> PreferenceData:
        """The same replies with ``rater``'s verdicts (:func:`relabel`): e.g. the biased rater's data set."""
        train, test = relabel(self.train_pairs, rater, seed), relabel(self.test_pairs, rater, seed + 1)
        return replace(self, rater=rater, train_pairs=train, test_pairs=test)


def preference_data(config: RewardModelConfig | None = None) -> PreferenceData:
    """Load (or train once) the SFT policy, sample two replies per problem from it and let ``config.rater()``
    label them, on ``num_train_problems`` training and ``num_test_problems`` held-out problems."""
    from edurl.llm.renderer import ChatMLRenderer
    from edurl.llm.sft import load_or_train_sft

    config = config or RewardModelConfig()
    rater = config.rater()
    with torch_threads(config.num_threads, config.device):
        policy, tokenizer, _, path = load_or_train_sft(
            replace(config.sft, device=config.device), progress=config.progress
        )
        renderer = ChatMLRenderer(tokenizer)
        task = config.sft.task()
        pairs = {}
        for split, n in (("train", config.num_train_problems), ("test", config.num_test_problems)):
            problems = task.sample(n, split=split, seed=config.seed)
            pairs[split] = sample_pairs(
                policy,
                renderer,
                problems,
                rater,
                seed=config.seed,
                temperature=config.sample_temperature,
                max_tokens=config.max_tokens,
            )
    return PreferenceData(policy, tokenizer, str(path), rater, pairs["train"], pairs["test"])


def length_preference_data(config: RewardModelConfig | None = None) -> PreferenceData:
    """:func:`preference_data`'s control: the same SFT checkpoint and problems, but :func:`length_pairs` labelled
    by ``config.rater()`` (give the config a ``length_bonus``), a preference visible in the reply itself."""
    from edurl.llm.renderer import ChatMLRenderer
    from edurl.llm.sft import load_or_train_sft

    config = config or RewardModelConfig(length_bonus=0.5)
    rater = config.rater()
    policy, tokenizer, _, path = load_or_train_sft(replace(config.sft, device=config.device), progress=config.progress)
    renderer, task = ChatMLRenderer(tokenizer), config.sft.task()
    pairs = {
        split: length_pairs(renderer, task.sample(n, split=split, seed=config.seed), rater, seed=config.seed + k)
        for k, (split, n) in enumerate((("train", config.num_train_problems), ("test", config.num_test_problems)))
    }
    return PreferenceData(policy, tokenizer, str(path), rater, pairs["train"], pairs["test"])


def train_reward_model(
    config: RewardModelConfig | None = None, data: PreferenceData | None = None
) -> RewardModelResult:
    """Fit a Bradley-Terry reward model that starts from the SFT weights (:func:`load_reward_model`) on
    ``data``'s pairs, or on pairs made by :func:`preference_data` from ``config`` when ``data`` is None."""
    config = config or RewardModelConfig()
    data = data or preference_data(config)
    with torch_threads(config.num_threads, config.device):
        reward_model = load_reward_model(data.path, seed=config.seed).to(pick_device(config.device))
        history = fit_reward_model(
            reward_model,
            data.train_pairs,
            data.test_pairs,
            batch_size=config.batch_size,
            epochs=config.epochs,
            learning_rate=config.learning_rate,
            eval_every=config.eval_every,
            seed=config.seed,
            progress=config.progress,
        )
    return RewardModelResult(reward_model, data.tokenizer, history, data.train_pairs, data.test_pairs)


# ---------------------------------------------------------------- the reward model as RL's reward


class RewardModelReward:
    """A reward model as the reward of :func:`edurl.llm.grpo.train_grpo` (its ``reward_fn``): each completion's
    reward is the model's scalar for ``prompt + completion``. It also logs what the simulated people think of
    the same completions, which RL never sees:

    * ``env/all/reward/proxy``: the mean reward-model score (what RL maximises);
    * ``env/all/reward/gold``: the mean :func:`gold_score` (what people want);
    * ``env/all/reward/rater``: the mean score of ``rater`` (the rater whose labels trained the model);
    * ``env/all/reply_chars``: the mean reply length in characters.
    """

    def __init__(self, reward_model, renderer, rater: Rater | None = None, batch_size: int = 512):
        self.reward_model = reward_model
        self.renderer = renderer
        self.rater = rater or Rater()
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, problems, prompts, completions) -> tuple[torch.Tensor, dict[str, float]]:
        P, G = len(completions), len(completions[0])
        sizes = sorted({len(group) for group in completions})
        if len(sizes) > 1 or len(prompts) != P:
            raise ValueError(
                f"RewardModelReward scores {len(prompts)} prompts with groups of {sizes} completions: it needs one "
                "group per prompt and every group of the same size (as train_grpo samples them)"
            )
        flat_prompts = [prompts[i] for i in range(P) for _ in range(G)]
        flat = [c for group in completions for c in group]
        was_training = self.reward_model.training
        self.reward_model.eval()
        scores = torch.cat(
            [
                score_sequences(self.reward_model, flat_prompts[k : k + self.batch_size], flat[k : k + self.batch_size])
                for k in range(0, len(flat), self.batch_size)
            ]
        ).cpu()
        self.reward_model.train(was_training)
        # the reply's text only (whether it ended is not used here), read by the sampler's stop_reason, which
        # train_grpo hands over with each completion (a plain list of ids from elsewhere is read as one that
        # stopped): "stop" leaves a special last token, such as an <|endoftext|> it stopped on, out of the text
        texts = [self.renderer.parse_response(c, getattr(c, "stop_reason", None) or "stop")[0]["content"] for c in flat]
        answers = [problems[i].answer for i in range(P) for _ in range(G)]
        return scores.view(P, G), {
            "env/all/reward/proxy": float(scores.mean()),
            "env/all/reward/gold": sum(map(gold_score, texts, answers)) / len(texts),
            "env/all/reward/rater": sum(map(self.rater.score, texts, answers)) / len(texts),
            "env/all/reply_chars": sum(map(len, texts)) / len(texts),
        }


# ---------------------------------------------------------------- DPO


def reply_logprobs(
    model,
    prompts: Sequence[Sequence[int]],
    replies: Sequence[Sequence[int]],
    pad_id: int,
    share_prompts: bool = True,
) -> torch.Tensor:
    """``log pi(reply | prompt)`` summed over each reply's tokens: shape ``(B,)``, with gradient.

    The rows are laid out as Chapter 7's datums (input ``prompt + reply`` without its last token, targets shifted
    by one, mask 1 on the reply's targets) and scored by :func:`edurl.llm.shared_prefix.token_logprobs`. A pair's
    chosen and rejected replies share their prompt, so with ``share_prompts`` each distinct prompt runs through the
    model once and its replies read its KV cache: the same log-probs and gradients (a test checks both), for
    less compute."""
    from edurl.llm.padding import pad
    from edurl.llm.shared_prefix import token_logprobs

    _check_rows(prompts, replies)
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(
            f"prompt {empty[0]} is empty ({len(empty)} of {len(prompts)} are): a reply's first token is scored "
            "given the prompt's last one, so each prompt needs at least one token (e.g. a BOS or a chat header)"
        )

    rows = [list(p) + list(r) for p, r in zip(prompts, replies)]
    ids, attn = pad([row[:-1] for row in rows], pad_id, device=model.device)  # (B, T)
    targets, _ = pad([row[1:] for row in rows], 0, device=model.device)  # (B, T)
    masks = [[0.0] * (len(p) - 1) + [1.0] * len(r) for p, r in zip(prompts, replies)]
    mask, _ = pad(masks, 0, dtype=torch.float32, device=model.device)  # (B, T): 1 on the reply's targets
    logp, _ = token_logprobs(
        model,
        ids,
        attn,
        targets,
        mask,
        share_prompts=share_prompts,
        pad_token_id=pad_id,
        model_config=model.config,
        model=model,  # the replies run packed, without their padding (edurl.llm.packed)
        prompt_grad=False,  # the sum below reads only the replies' positions
    )
    return torch.where(mask.bool(), logp, torch.zeros_like(logp)).sum(1)


@dataclass
class DPOConfig(PairTrainingConfig):
    """DPO on labelled pairs: the policy and its frozen reference both start from the SFT weights."""

    beta: float = 0.1
    """Strength of the implicit KL tie to the reference (DPO's beta)."""
    learning_rate: float = 1e-4
    """AdamW learning rate (constant)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, positive=("beta",))


@dataclass
class DPOResult:
    """The DPO policy and its learning curve."""

    policy: torch.nn.Module
    reference: torch.nn.Module
    history: list[dict]
    """One row per evaluation: ``step``, ``train/loss`` and, on the held-out pairs, ``test/expected_accuracy``,
    ``test/accuracy`` and ``test/ceiling`` of the implicit reward, ``test/loss``, and the mean change of the
    chosen and rejected replies' log-probs from the reference (``test/chosen_logp_change``, ...)."""

    @property
    def final(self) -> dict[str, float]:
        return self.history[-1]


@torch.no_grad()
def dpo_metrics(policy, reference, pairs: Sequence[PreferencePair], beta: float, pad_id: int, batch_size: int = 256):
    """DPO's implicit reward ``beta * log(pi / ref)`` judged as a reward model on ``pairs`` (the keys of
    :func:`pair_metrics`), and how far the chosen and rejected replies' log-probs moved from the reference."""
    if len(pairs) == 0:
        raise ValueError("pairs is empty")
    was_training = policy.training
    policy.eval()
    cols = {"pi_a": [], "pi_b": [], "ref_a": [], "ref_b": []}
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        prompts = [p.prompt for p in chunk]
        replies = [p.reply_a for p in chunk] + [p.reply_b for p in chunk]
        for who, model in (("pi", policy), ("ref", reference)):
            both = reply_logprobs(model, prompts + prompts, replies, pad_id).cpu()  # each prompt runs once
            cols[f"{who}_a"].append(both[: len(chunk)])
            cols[f"{who}_b"].append(both[len(chunk) :])
    policy.train(was_training)
    c = {k: torch.cat(v).double() for k, v in cols.items()}
    r_a, r_b = implicit_rewards(c["pi_a"], c["ref_a"], beta), implicit_rewards(c["pi_b"], c["ref_b"], beta)
    metrics = _rank_metrics(r_a, r_b, pairs)
    a_preferred = torch.tensor([p.a_preferred for p in pairs])
    change_a, change_b = c["pi_a"] - c["ref_a"], c["pi_b"] - c["ref_b"]
    metrics["chosen_logp_change"] = float(torch.where(a_preferred, change_a, change_b).mean())
    metrics["rejected_logp_change"] = float(torch.where(a_preferred, change_b, change_a).mean())
    return metrics


def train_dpo(data: PreferenceData, config: DPOConfig | None = None) -> DPOResult:
    """Minimise :func:`dpo_loss` over ``data.train_pairs`` with AdamW, from the SFT weights; evaluate the
    implicit reward on ``data.test_pairs`` every ``eval_every`` steps."""
    from transformers import AutoModelForCausalLM

    from edurl.llm.clients import disable_dropout

    config = config or DPOConfig()
    pairs, test_pairs = data.train_pairs, data.test_pairs
    if not pairs or not test_pairs:
        raise ValueError(f"need training and held-out pairs, got {len(pairs)} and {len(test_pairs)}")
    pad_id = data.tokenizer.pad_token_id
    dev = pick_device(config.device)
    with torch_threads(config.num_threads, config.device):
        # float32 whatever the checkpoint stores: AdamW's small steps round away in bfloat16 (train_on_pairs)
        policy = disable_dropout(AutoModelForCausalLM.from_pretrained(data.path, dtype=torch.float32).to(dev))
        reference = disable_dropout(AutoModelForCausalLM.from_pretrained(data.path, dtype=torch.float32).to(dev))
        reference.eval()
        reference.requires_grad_(False)

        def loss_on(batch: list[PreferencePair]) -> torch.Tensor:
            prompts = [p.prompt for p in batch] * 2
            replies = [p.chosen for p in batch] + [p.rejected for p in batch]
            logp = reply_logprobs(policy, prompts, replies, pad_id)  # (2B,): chosen then rejected
            with torch.no_grad():
                ref = reply_logprobs(reference, prompts, replies, pad_id)
            B = len(batch)
            return dpo_loss(logp[:B], logp[B:], ref[:B], ref[B:], config.beta)

        evaluate = lambda: _prefixed(dpo_metrics(policy, reference, test_pairs, config.beta, pad_id))  # noqa: E731
        history = train_on_pairs(policy, pairs, loss_on, evaluate, config, "DPO")
    return DPOResult(policy, reference, history)


@torch.no_grad()
def mean_gold_score(
    model, renderer, problems: Sequence, seed: int = 0, temperature: float = 1.0, max_tokens: int = 16, samples: int = 4
) -> float:
    """The simulated people's verdict on a policy: the mean :func:`gold_score` of ``samples`` replies per problem,
    sampled at ``temperature``. Compares any two policies (SFT, RL against a reward model, DPO) on one scale."""
    from edurl.llm.sampling import SamplingParams, sample

    prompts = [renderer.build_generation_prompt(p.messages()) for p in problems]
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, stop=renderer.get_stop_sequences(), seed=seed
    )
    completions = sample(model, prompts, samples, params, pad_token_id=renderer.tokenizer.pad_token_id)
    scores = [
        gold_score(renderer.parse_response(c.tokens, c.stop_reason)[0]["content"], problems[k // samples].answer)
        for k, c in enumerate(completions)
    ]
    return sum(scores) / len(scores)
