import copy
import math
import random

import pytest
import torch

from edurl.llm.preference import (
    UNPARSEABLE_SCORE,
    DPOConfig,
    PairTrainingConfig,
    PreferenceData,
    PreferencePair,
    Rater,
    RewardModelConfig,
    RewardModelReward,
    bradley_terry_loss,
    ceiling,
    dpo_loss,
    dpo_metrics,
    fit_reward_model,
    gold_score,
    implicit_rewards,
    kl_shaped_rewards,
    length_pairs,
    load_reward_model,
    mean_gold_score,
    pair_metrics,
    relabel,
    reply_logprobs,
    rlhf_sft_config,
    sample_pairs,
    score_sequences,
    train_dpo,
    train_on_pairs,
)
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.sft import SFTConfig
from edurl.llm.tasks import ArithmeticTask

# ---------------------------------------------------------------- losses, by hand


def test_bradley_terry_loss_by_hand():
    assert bradley_terry_loss(torch.zeros(4), torch.zeros(4)).item() == pytest.approx(math.log(2))
    # margin log 3: sigmoid = 3/4
    assert bradley_terry_loss(torch.tensor([math.log(3)]), torch.zeros(1)).item() == pytest.approx(-math.log(0.75))
    # the mean over pairs, not the sum
    two = bradley_terry_loss(torch.tensor([math.log(3), 0.0]), torch.tensor([0.0, 0.0]))
    assert two.item() == pytest.approx((-math.log(0.75) + math.log(2)) / 2)
    # stable at huge margins, with the right gradient: d/dr_c = -(1 - sigmoid(margin)) / B
    r_c = torch.tensor([60.0, -60.0], requires_grad=True)
    loss = bradley_terry_loss(r_c, torch.zeros(2))
    loss.backward()
    assert loss.item() == pytest.approx(60 / 2, rel=1e-6) and torch.isfinite(r_c.grad).all()
    assert r_c.grad.tolist() == pytest.approx([0.0, -0.5], abs=1e-6)


def test_dpo_loss_by_hand():
    zeros = torch.zeros(3)
    assert dpo_loss(zeros, zeros, zeros, zeros, beta=0.1).item() == pytest.approx(math.log(2))
    # policy = reference: log 2 whatever the log-probs and beta
    lp_c, lp_r = torch.tensor([-3.0, -1.0]), torch.tensor([-2.0, -5.0])
    assert dpo_loss(lp_c, lp_r, lp_c, lp_r, beta=0.5).item() == pytest.approx(math.log(2))
    # beta * ((pi_c - ref_c) - (pi_r - ref_r)) = 0.5 * ((-1 - -3) - (-4 - -2)) = 0.5 * 4 = 2
    loss = dpo_loss(torch.tensor([-1.0]), torch.tensor([-4.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), beta=0.5)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-2))))
    assert implicit_rewards(torch.tensor([-1.0]), torch.tensor([-3.0]), 0.5).item() == pytest.approx(1.0)
    # DPO is Bradley-Terry on the implicit rewards
    pc, pr, rc, rr = (torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(4))
    bt = bradley_terry_loss(implicit_rewards(pc, rc, 0.3), implicit_rewards(pr, rr, 0.3))
    assert dpo_loss(pc, pr, rc, rr, 0.3).item() == pytest.approx(bt.item())


def test_kl_shaped_rewards_by_hand():
    logprobs = torch.tensor([[9.0, -1.0, -2.0, 7.0]])  # 9 and 7 sit on masked positions (prompt, padding)
    ref = torch.tensor([[0.0, -1.5, -2.25, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0]])
    out = kl_shaped_rewards(torch.tensor([1.0]), logprobs, ref, mask, kl_coef=0.4)
    assert out.tolist() == pytest.approx([1 - 0.4 * (0.5 + 0.25)])
    assert kl_shaped_rewards(torch.tensor([1.0]), logprobs, ref, mask.bool(), 0.0).tolist() == [1.0]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: bradley_terry_loss(torch.zeros(3), torch.zeros(2)), "same shape"),
        (lambda: bradley_terry_loss([0.0], [1.0]), "torch.Tensor"),
        (lambda: bradley_terry_loss(torch.zeros(2, 2), torch.zeros(2, 2)), "1-D"),
        (lambda: dpo_loss(*[torch.zeros(2)] * 4, beta=0.0), "beta must be"),
        (lambda: dpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(3), torch.zeros(2), beta=0.1), "same shape"),
        (
            lambda: kl_shaped_rewards(torch.zeros(2), torch.zeros(3, 4), torch.zeros(3, 4), torch.ones(3, 4), 0.1),
            "one reward per reply",
        ),
        (
            lambda: kl_shaped_rewards(torch.zeros(1), torch.zeros(1, 4), torch.zeros(1, 4), torch.ones(1, 4), -1.0),
            "kl_coef",
        ),
    ],
)
def test_bad_inputs_say_what_is_wrong(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


# ---------------------------------------------------------------- raters and the ceiling


def test_gold_score_and_raters():
    # by hand: 1.0 for the opening, -0.5 per filler, -0.3 * log(1 + |error|)
    assert gold_score("\\boxed{57}", "57") == 0.0
    assert gold_score("\\boxed{58}", "57") == pytest.approx(-0.3 * math.log(2))
    assert gold_score("The answer is \\boxed{47}", "57") == pytest.approx(1.0 - 0.3 * math.log(11))
    assert gold_score("the answer is \\boxed{47}", "57") == pytest.approx(-0.3 * math.log(11))  # not the opening
    assert gold_score("Sure! \\boxed{57} ok ok", "57") == pytest.approx(-1.0)
    assert gold_score("The answer is \\boxed{56} ok", "57") == pytest.approx(0.5 - 0.3 * math.log(2))
    assert gold_score("57", "57") == UNPARSEABLE_SCORE == gold_score("\\boxed{5x}", "57")
    assert gold_score("The answer is 57 ok", "57") == UNPARSEABLE_SCORE  # manner does not rescue a missing box
    gold = Rater(temperature=0.5)
    assert gold.prefer_probability("\\boxed{57}", "\\boxed{58}", "57") == pytest.approx(
        1 / (1 + math.exp(-2 * 0.3 * math.log(2)))
    )
    assert gold.prefer_probability("\\boxed{1}", "\\boxed{1}", "57") == 0.5
    # the biased rater likes length: a longer wrong reply can beat a right one
    biased = Rater(temperature=0.5, length_bonus=0.2)
    assert biased.score("\\boxed{57}", "57") == pytest.approx(0.2 * len("\\boxed{57}"))
    assert biased.score("\\boxed{57}xxxxxxxxxx", "57") > gold.score("\\boxed{57}", "57")
    with pytest.raises(ValueError, match="temperature"):
        Rater(temperature=0.0)
    with pytest.raises(ValueError, match="length_bonus"):
        Rater(length_bonus=-1.0)
    # far-apart scores and huge numbers once raised OverflowError (exp of 1e3; a 309-digit int as a float)
    sharp = Rater(temperature=0.001)
    assert 0.0 <= sharp.prefer_probability("\\boxed{1}", "The answer is \\boxed{57}", "57") < 1e-300
    assert sharp.prefer_probability("The answer is \\boxed{57}", "\\boxed{1}", "57") == 1.0
    huge = "\\boxed{" + "9" * 400 + "}"
    assert gold_score(huge, "57") == pytest.approx(-0.3 * 400 * math.log(10), rel=1e-3)
    assert gold_score("\\boxed{" + "9" * 5000 + "}", "57") < gold_score(huge, "57")  # past int()'s digit limit
    assert gold.prefer_probability("\\boxed{57}", huge, "57") == pytest.approx(1.0)


def test_ceiling_by_hand_and_by_simulation():
    assert ceiling([0.9, 0.5, 0.2]) == pytest.approx((0.9 + 0.5 + 0.8) / 3)
    assert ceiling([1.0, 0.0]) == 1.0
    # simulated labels: the predictor that knows p reaches the ceiling, up to sampling noise
    rng = random.Random(0)
    p = [rng.random() for _ in range(20_000)]
    hits = [(rng.random() < q) == (q > 0.5) for q in p]
    assert sum(hits) / len(hits) == pytest.approx(ceiling(p), abs=0.01)
    with pytest.raises(ValueError, match="probabilities"):
        ceiling([1.5])
    with pytest.raises(ValueError, match="probabilities"):  # once passed the range check and gave nan
        ceiling([0.5, float("nan")])


# ---------------------------------------------------------------- pairs and the reward model


def _pair(prompt, a, b, p_a, a_preferred):
    return PreferencePair(tuple(prompt), tuple(a), tuple(b), "", "", "0", p_a, a_preferred)


class SumOfTokensRM(torch.nn.Module):
    """A stand-in reward model whose score is known: the sum of a sequence's non-pad token ids."""

    def __init__(self):
        super().__init__()
        self.config = type("C", (), {"pad_token_id": 0})()
        self.device = torch.device("cpu")

    def forward(self, input_ids, attention_mask):
        return type("Out", (), {"logits": (input_ids * attention_mask).sum(1, keepdim=True).float()})()


def test_score_sequences_and_pair_metrics_by_hand():
    rm = SumOfTokensRM()
    scores = score_sequences(rm, [[1, 2], [3]], [[4], [5, 6, 7]])
    assert scores.tolist() == [7.0, 21.0]
    pairs = [
        _pair([1], [5], [2], p_a=0.9, a_preferred=True),  # r_a 6 > r_b 3: right; margin +3
        _pair([1], [5], [2], p_a=0.9, a_preferred=False),  # label against the odds: wrong; margin -3
        _pair([1], [2], [2], p_a=0.5, a_preferred=True),  # a tie counts half
        _pair([1], [1], [4], p_a=0.2, a_preferred=False),  # r_b higher, b chosen: right; margin +3
    ]
    m = pair_metrics(rm, pairs, batch_size=3)
    assert m["accuracy"] == pytest.approx((1 + 0 + 0.5 + 1) / 4)
    assert m["expected_accuracy"] == pytest.approx((0.9 + 0.9 + 0.5 + 0.8) / 4)
    assert m["ceiling"] == pytest.approx((0.9 + 0.9 + 0.5 + 0.8) / 4)
    assert m["margin"] == pytest.approx((3 - 3 + 0 + 3) / 4)
    with pytest.raises(ValueError, match="empty"):
        pair_metrics(rm, [])


@pytest.fixture(scope="module")
def saved_lm(tmp_path_factory, char_tokenizer, small_model):
    """A randomly initialised tiny causal LM saved as a Hugging Face folder, as a real checkpoint would be."""
    path = tmp_path_factory.mktemp("lm")
    small_model.save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return path


def test_load_reward_model_keeps_the_lm_weights_and_adds_a_scalar_head(saved_lm, small_model):
    rm = load_reward_model(saved_lm, seed=0)
    assert type(rm).__name__.endswith("ForSequenceClassification") and rm.config.num_labels == 1
    assert torch.equal(rm.model.embed_tokens.weight, small_model.model.embed_tokens.weight)
    assert torch.equal(load_reward_model(saved_lm, seed=0).score.weight, rm.score.weight)  # the head is seeded
    scores = score_sequences(rm, [[5, 6], [5]], [[7, 8], [7, 8, 9]])
    assert scores.shape == (2,) and scores.requires_grad
    # right padding does not change a row's score: the head reads the last real token
    alone = score_sequences(rm, [[5, 6]], [[7, 8]])
    assert alone.item() == pytest.approx(scores[0].item(), abs=1e-5)


def test_a_float64_reward_model_scores_in_float64(saved_lm):
    rm = load_reward_model(saved_lm, seed=0, dtype=torch.float64)
    prompts, replies = [[5, 6], [5, 6], [9]], [[7, 8], [7], [10, 11]]
    for share in (True, False):  # the shared-prompt pass and the whole rows; both once cast to float32
        assert score_sequences(rm, prompts, replies, share_prompts=share).dtype == torch.float64
    assert score_sequences(load_reward_model(saved_lm, seed=0), prompts, replies).dtype == torch.float32


def test_score_sequences_with_shared_prompts_equals_whole_rows(saved_lm):
    """Replies that share a prompt (a pair, or RL's group): one prompt pass, the same scores and gradients."""
    rm = load_reward_model(saved_lm, seed=0)
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11], [9, 10, 11], [9, 10, 11]]
    replies = [[12, 13], [14, 15, 16], [17], [18, 19, 20, 21], [22, 23]]
    results = []
    for share in (True, False):
        rm.zero_grad(set_to_none=True)
        scores = score_sequences(rm, prompts, replies, share_prompts=share)
        (scores * torch.arange(1.0, 6.0)).sum().backward()
        results.append((scores.detach(), [p.grad.clone() for p in rm.parameters()]))
    (shared, shared_grads), (whole, whole_grads) = results
    assert torch.allclose(shared, whole, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(shared_grads, whole_grads))
    # each row's score is its own: scoring a row alone (no sharing possible) gives the same number
    alone = score_sequences(rm, [prompts[3]], [replies[3]])
    assert alone.item() == pytest.approx(shared[3].item(), abs=1e-5)


def test_fit_reward_model_learns_a_learnable_rater(saved_lm, char_tokenizer):
    """Replies that differ only in length, labelled by a rater that likes length: the reward model must get
    close to the exact ceiling in a few dozen steps."""
    pairs = _length_pairs(char_tokenizer, 384)
    rm = load_reward_model(saved_lm, seed=0)
    history = fit_reward_model(
        rm, pairs[:320], pairs[320:], batch_size=32, epochs=4, learning_rate=3e-3, eval_every=10, progress=False
    )
    first, last = history[0], history[-1]
    assert last["test/expected_accuracy"] > first["test/expected_accuracy"] + 0.2
    assert last["test/expected_accuracy"] >= 0.9 * last["test/ceiling"]
    assert last["test/margin"] > 0 and last["train/loss"] < math.log(2)


def test_a_bf16_checkpoint_trains_in_float32_or_is_refused(small_model, char_tokenizer, tmp_path):
    """Qwen2.5 stores bfloat16, and from_pretrained keeps the checkpoint's dtype: AdamW then stepped bf16 weights,
    where a step under half the gap between neighbouring values (3e-4 against a norm weight of 1) changes nothing."""
    path = tmp_path / "bf16"
    copy.deepcopy(small_model).to(torch.bfloat16).save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    rm = load_reward_model(path)
    assert {p.dtype for p in rm.parameters()} == {torch.float32}
    pairs = _length_pairs(char_tokenizer, 8)
    before = rm.model.norm.weight.detach().clone()
    fit_reward_model(rm, pairs[:4], pairs[4:], batch_size=4, epochs=1, learning_rate=3e-4, progress=False)
    assert not torch.equal(rm.model.norm.weight, before)  # in bf16, 1 - 3e-4 rounds back to 1
    with pytest.raises(ValueError, match=r"stored in bfloat16.*load_reward_model\(path\) does by default"):
        fit_reward_model(rm.to(torch.bfloat16), pairs[:4], pairs[4:], batch_size=4, epochs=1, progress=False)


def test_sample_pairs_labels_distinct_replies(small_model, char_tokenizer):
    renderer = ChatMLRenderer(char_tokenizer)
    problems = ArithmeticTask(1).sample(8, seed=0)
    pairs = sample_pairs(small_model, renderer, problems, Rater(), seed=0, max_tokens=6)
    assert pairs and all(p.text_a != p.text_b for p in pairs)
    assert all(0.0 <= p.p_a <= 1.0 and p.chosen in (p.reply_a, p.reply_b) for p in pairs)
    assert sample_pairs(small_model, renderer, problems, Rater(), seed=0, max_tokens=6) == pairs  # seeded
    with pytest.raises(ValueError, match="samples_per_problem"):
        sample_pairs(small_model, renderer, problems, Rater(), samples_per_problem=1)


def test_relabel_keeps_the_replies_and_draws_the_new_raters_verdicts(small_model, char_tokenizer):
    renderer = ChatMLRenderer(char_tokenizer)
    pairs = sample_pairs(small_model, renderer, ArithmeticTask(1).sample(8, seed=0), Rater(), seed=0, max_tokens=6)
    biased = Rater(length_bonus=0.5)
    again = relabel(pairs, biased, seed=3)
    assert [(p.prompt, p.reply_a, p.reply_b) for p in again] == [(p.prompt, p.reply_a, p.reply_b) for p in pairs]
    assert [p.p_a for p in again] == [biased.prefer_probability(p.text_a, p.text_b, p.answer) for p in pairs]
    assert relabel(pairs, biased, seed=3) == again  # seeded
    # labels follow the probabilities: with many copies of one pair, the share labelled a is near p_a
    many = relabel([pairs[0]] * 4000, biased, seed=0)
    assert sum(p.a_preferred for p in many) / 4000 == pytest.approx(many[0].p_a, abs=0.03)


def test_rlhf_sft_config_is_a_styled_warm_start_with_its_own_cache_key():
    config = rlhf_sft_config(seed=3)
    assert config.styled and config.target_pass_at_1 is None and config.max_steps == 600 and config.seed == 3
    assert config.key() != SFTConfig(seed=3).key()


def test_reward_model_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="RewardModelConfig.batch_size"):
        RewardModelConfig(batch_size=0)
    with pytest.raises(ValueError, match="RewardModelConfig.length_bonus"):
        RewardModelConfig(length_bonus=-0.1)


# ---------------------------------------------------------------- the reward model as RL's reward


def test_reward_model_reward_scores_each_completion_and_logs_gold(saved_lm, char_tokenizer):
    renderer = ChatMLRenderer(char_tokenizer)
    rm = load_reward_model(saved_lm, seed=0)
    problems = ArithmeticTask(1).sample(2, seed=0)
    prompts = [renderer.build_generation_prompt(p.messages()) for p in problems]
    stop = list(renderer.get_stop_sequences())
    enc = lambda t: char_tokenizer.encode(t, add_special_tokens=False) + stop  # noqa: E731
    replies = [[f"\\boxed{{{problems[0].answer}}}", "no box"], ["\\boxed{-5}", f"\\boxed{{{problems[1].answer}}}"]]
    completions = [[enc(t) for t in group] for group in replies]
    # one reply ends on <|endoftext|>, as a Qwen2.5-Instruct reply may (sample() stops on its generation config's
    # EOS ids): its text, which the rater and reply_chars read, once held the token's 13 characters
    completions[1][1] = completions[1][1][: -len(stop)] + [char_tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    rater = Rater(length_bonus=0.25)
    rewards, metrics = RewardModelReward(rm, renderer, rater=rater, batch_size=3)(problems, prompts, completions)
    assert rewards.shape == (2, 2) and not rewards.requires_grad
    one_by_one = [score_sequences(rm, [prompts[i]], [c]).item() for i, g in enumerate(completions) for c in g]
    assert rewards.flatten().tolist() == pytest.approx(one_by_one, abs=1e-5)
    gold = [0.0, UNPARSEABLE_SCORE, -0.3 * math.log1p(abs(-5 - int(problems[1].answer))), 0.0]
    assert metrics["env/all/reward/gold"] == pytest.approx(sum(gold) / 4)
    texts = [t for g in replies for t in g]
    assert metrics["env/all/reward/rater"] == pytest.approx((sum(gold) + 0.25 * sum(map(len, texts))) / 4)
    assert metrics["env/all/reward/proxy"] == pytest.approx(sum(one_by_one) / 4, abs=1e-5)
    assert metrics["env/all/reply_chars"] == pytest.approx(sum(map(len, texts)) / 4)


def test_reward_model_reward_refuses_groups_of_different_sizes():
    # groups of 2, 1 and 3 for 3 prompts: P * G = 3 * 2 = 6 completions in all, so the (P, G) view once fitted and
    # scored the flat list against the wrong prompts
    prompts, completions = [[1], [2], [3]], [[[4], [5]], [[6]], [[7], [8], [9]]]
    reward = RewardModelReward(SumOfTokensRM(), renderer=None)
    with pytest.raises(ValueError, match=r"groups of \[1, 2, 3\] completions"):
        reward([None] * 3, prompts, completions)
    with pytest.raises(ValueError, match="one group per prompt"):
        reward([None] * 2, prompts[:2], completions[:1])


# ---------------------------------------------------------------- DPO


def test_train_on_pairs_takes_an_evaluate_with_other_keys():
    # the loop is shared and documented as taking any evaluate() -> dict; its progress bar once read
    # test/expected_accuracy and raised a KeyError at the first evaluation, losing the run
    model = torch.nn.Linear(1, 1, bias=False)
    config = PairTrainingConfig(batch_size=2, epochs=1, eval_every=1, progress=False)
    history = train_on_pairs(
        model, [0, 1, 2, 3], lambda batch: model.weight.sum() ** 2, lambda: {"my/acc": 1.0}, config, "x"
    )
    assert [row["step"] for row in history] == [0, 1, 2] and all(row["my/acc"] == 1.0 for row in history)


def test_dpo_metrics_names_empty_pairs(small_model):
    with pytest.raises(ValueError, match="pairs is empty"):  # was torch.cat's "expected a non-empty list"
        dpo_metrics(small_model, small_model, [], beta=0.1, pad_id=0)


def test_reply_logprobs_refuses_an_empty_prompt(small_model):
    with pytest.raises(ValueError, match="prompt 0 is empty"):  # was a shape mismatch deep in the mask
        reply_logprobs(small_model, [[], []], [[5, 6, 7], [8, 9]], pad_id=0)


def test_reply_logprobs_equals_a_token_by_token_reference(small_model):
    prompts, replies = [[5, 6, 7], [8]], [[9, 10], [11, 12, 13, 14]]
    got = reply_logprobs(small_model, prompts, replies, pad_id=0)
    with torch.no_grad():
        for b, (p, r) in enumerate(zip(prompts, replies)):
            total = 0.0
            for k, token in enumerate(r):  # log p(r_k | p + r_<k), each from its own unpadded forward pass
                logits = small_model(input_ids=torch.tensor([p + r[:k]])).logits[0, -1]
                total += torch.log_softmax(logits.double(), -1)[token].item()
            assert got[b].item() == pytest.approx(total, abs=1e-4)
    assert got.requires_grad


def test_reply_logprobs_with_shared_prompts_equals_whole_rows(small_model):
    """A pair's two replies share their prompt: the shared-prefix pass gives the same log-probs and gradients."""
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11], [9, 10, 11]]
    replies = [[12, 13], [14, 15, 16], [17], [18, 19, 20, 21]]
    results = []
    for share in (True, False):
        small_model.zero_grad(set_to_none=True)
        lp = reply_logprobs(small_model, prompts, replies, pad_id=0, share_prompts=share)
        lp.sum().backward()
        results.append((lp.detach(), [p.grad.clone() for p in small_model.parameters()]))
    small_model.zero_grad(set_to_none=True)
    (shared, shared_grads), (whole, whole_grads) = results
    assert torch.allclose(shared, whole, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(shared_grads, whole_grads))


def _length_pairs(char_tokenizer, n: int, seed: int = 0) -> list[PreferencePair]:
    problems = ArithmeticTask(2).sample(n, seed=seed)
    return length_pairs(ChatMLRenderer(char_tokenizer), problems, Rater(temperature=0.5, length_bonus=0.5), seed=seed)


def test_train_dpo_learns_the_raters_preference(saved_lm, char_tokenizer):
    pairs = _length_pairs(char_tokenizer, 320)
    data = PreferenceData(None, char_tokenizer, str(saved_lm), Rater(length_bonus=0.5), pairs[:256], pairs[256:])
    config = DPOConfig(beta=0.5, batch_size=32, epochs=3, learning_rate=3e-3, eval_every=8, progress=False)
    result = train_dpo(data, config)
    first, last = result.history[0], result.final
    # at the start the policy is the reference: every implicit reward is 0, the loss log 2, ties count half
    assert first["test/loss"] == pytest.approx(math.log(2), abs=1e-6) and first["test/expected_accuracy"] == 0.5
    assert first["test/chosen_logp_change"] == 0.0
    assert last["test/expected_accuracy"] >= 0.9 * last["test/ceiling"]
    assert last["test/margin"] > 0 and last["train/loss"] < math.log(2)
    seconds = [row["time/train"] for row in result.history]  # training time so far, evaluations excluded
    assert seconds[0] == 0.0 and seconds[-1] > 0 and seconds == sorted(seconds)
    assert [row["step"] for row in result.history] == [0, 8, 16, 24]  # 256 pairs / 32 = 8 steps an epoch
    # the frozen reference did not move
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(saved_lm)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), result.reference.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(fresh.parameters(), result.policy.parameters()))
    with pytest.raises(ValueError, match="DPOConfig.beta"):
        DPOConfig(beta=0.0)
    with pytest.raises(ValueError, match="need training and held-out pairs"):
        train_dpo(PreferenceData(None, char_tokenizer, str(saved_lm), Rater(), pairs, []), config)


def test_mean_gold_score_is_the_mean_over_sampled_replies(small_model, char_tokenizer):
    renderer = ChatMLRenderer(char_tokenizer)
    problems = ArithmeticTask(1).sample(3, seed=0)
    score = mean_gold_score(small_model, renderer, problems, seed=0, max_tokens=6, samples=2)
    # an untrained model writes no boxed answer: every reply is unparseable
    assert score == pytest.approx(UNPARSEABLE_SCORE)


def test_length_pairs_differ_only_in_length_and_follow_the_rater(char_tokenizer):
    pairs = _length_pairs(char_tokenizer, 2000)
    assert all(set(p.text_a) == set(p.text_b) == {"x"} and p.text_a != p.text_b for p in pairs)
    assert len({p.prompt for p in pairs}) > 100  # one pair per problem, so the prompts vary
    rater = Rater(temperature=0.5, length_bonus=0.5)
    # by hand: 3 x's against 1 is a score gap of 1.0, so P(a preferred) = sigmoid(1.0 / 0.5) = 0.8808
    three_one = next(p for p in pairs if (p.text_a, p.text_b) == ("xxx", "x"))
    assert three_one.p_a == pytest.approx(1 / (1 + math.exp(-2.0))) == rater.prefer_probability("xxx", "x", "2")
    # labels are drawn from the rater's probabilities: their mean matches within 4 standard errors
    p = torch.tensor([q.p_a for q in pairs], dtype=torch.float64)
    drawn = torch.tensor([q.a_preferred for q in pairs], dtype=torch.float64)
    assert abs(drawn.mean() - p.mean()) < 4 * math.sqrt(float((p * (1 - p)).sum())) / len(pairs)
    with pytest.raises(ValueError, match="max_chars"):
        length_pairs(ChatMLRenderer(char_tokenizer), ArithmeticTask(1).sample(3), rater, max_chars=1)


def test_length_preference_data_is_the_control_on_the_sft_checkpoint(tmp_path, monkeypatch):
    from edurl.llm.preference import length_preference_data

    from .conftest import SMALL

    monkeypatch.setenv("EDURL_CACHE", str(tmp_path))
    sft = SFTConfig(model=SMALL, max_steps=2, batch_size=4, warmup_steps=1, num_threads=1, target_pass_at_1=None)
    config = RewardModelConfig(sft=sft, length_bonus=0.5, num_train_problems=16, num_test_problems=8, progress=False)
    data = length_preference_data(config)
    assert len(data.train_pairs) == 16 and len(data.test_pairs) == 8
    assert data.rater == Rater(temperature=0.5, length_bonus=0.5)
    assert all(set(p.text_a) == {"x"} for p in data.train_pairs + data.test_pairs)
    assert (tmp_path / "sft").is_dir() and str(tmp_path) in data.path  # the cached SFT checkpoint starts both


@pytest.mark.parametrize("share", [False, True])
def test_one_prompt_per_reply_or_a_clear_error(saved_lm, small_model, share):
    # zip used to cut 4 prompts with 2 replies down to 2 scores, and implicit_rewards broadcast (3,) and (3, 1) to (3, 3)
    rm = load_reward_model(saved_lm)
    prompt, replies = [5, 6, 7], [[9, 10], [11, 12]]
    with pytest.raises(ValueError, match="got 4 prompts and 2 replies"):
        score_sequences(rm, [prompt] * 4, replies, share_prompts=share)
    with pytest.raises(ValueError, match="got 3 prompts and 2 replies"):
        reply_logprobs(small_model, [prompt] * 3, replies, pad_id=0, share_prompts=share)
    with pytest.raises(ValueError, match="ref_logps"):
        implicit_rewards(torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([[-1.5], [-2.5], [-3.5]]), 0.1)


def _copy_with_config(src, dst, **changes):
    import json
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_load_reward_model_takes_the_pad_id_from_where_qwen_keeps_it(saved_lm, char_tokenizer, tmp_path):
    """Qwen2.5-0.5B-Instruct's config.json has no pad_token_id (its generation_config.json and its tokenizer have
    one), and load_reward_model refused the checkpoint the chapter says it loads."""
    from transformers import GenerationConfig

    pad = char_tokenizer.pad_token_id
    qwen_like = _copy_with_config(saved_lm, tmp_path / "qwen_like", pad_token_id=None)
    GenerationConfig(pad_token_id=pad, eos_token_id=[char_tokenizer.eos_token_id]).save_pretrained(qwen_like)
    assert load_reward_model(qwen_like).config.pad_token_id == pad
    (qwen_like / "generation_config.json").unlink()  # then the tokenizer's
    assert load_reward_model(qwen_like).config.pad_token_id == pad
    bare = _copy_with_config(saved_lm, tmp_path / "bare", pad_token_id=None)
    for f in bare.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()
    with pytest.raises(ValueError, match="no pad id in its config, its generation_config or its tokenizer"):
        load_reward_model(bare)
    # a Qwen2 folder without tokenizer files: AutoTokenizer builds a default Qwen2Tokenizer whose <|endoftext|> is
    # id 0, an id with another meaning in the model's own vocabulary; it must not be taken for the pad
    bare_qwen = _copy_with_config(bare, tmp_path / "bare_qwen", model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    with pytest.raises(ValueError, match="no pad id in its config, its generation_config or its tokenizer"):
        load_reward_model(bare_qwen)
    im_end = char_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ValueError, match=rf"pads with <\|im_end\|> \(id {im_end}\), a token replies end with"):
        load_reward_model(_copy_with_config(saved_lm, tmp_path / "pads_with_stop", pad_token_id=im_end))


def test_beta_and_empty_pairs_are_checked_the_same_way_everywhere():
    """implicit_rewards took beta = -1 (every reward's sign flipped), 0 and NaN; dpo_loss refused NumPy's float32
    and int64 betas with a message that called them not numbers; an empty batch gave NaN losses."""
    import numpy as np

    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    for bad in (-1.0, 0.0, float("nan"), float("inf"), True, "0.1"):
        with pytest.raises(ValueError, match="beta must be a finite number > 0"):
            implicit_rewards(lp, ref, bad)
        with pytest.raises(ValueError, match="beta must be a finite number > 0"):
            dpo_loss(lp, ref, ref, lp, bad)
    for good in (np.float32(0.5), np.int64(1), np.float64(0.5)):
        assert torch.allclose(implicit_rewards(lp, ref, good), float(good) * (lp - ref))
        assert dpo_loss(lp, ref, ref, lp, good).item() == pytest.approx(dpo_loss(lp, ref, ref, lp, float(good)).item())
    empty = torch.zeros(0)
    for loss in (lambda: bradley_terry_loss(empty, empty), lambda: dpo_loss(empty, empty, empty, empty, 0.1)):
        with pytest.raises(ValueError, match="empty: a mean over no pairs is NaN"):
            loss()


def test_a_reward_model_that_pads_with_a_stop_token_pads_with_a_spare_row(small_model, char_tokenizer, tmp_path):
    """Qwen2.5-Instruct pads with <|endoftext|>, and its generation config (so sample()) stops on it: the head reads
    each row's last non-pad token, so a reply that ended on <|endoftext|> scored exactly as the same reply cut
    off before it. A checkpoint with spare embedding rows (Qwen2.5 has 151936 for 151665 tokens) now pads with
    the first of them; one without is refused."""
    import copy

    from transformers import GenerationConfig

    endoftext, im_end = (char_tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>"))

    def instruct_like(model, name):
        model.save_pretrained(tmp_path / name)
        char_tokenizer.save_pretrained(tmp_path / name)
        path = _copy_with_config(tmp_path / name, tmp_path / f"{name}-qwen", pad_token_id=None)  # as Qwen's config
        GenerationConfig(pad_token_id=endoftext, eos_token_id=[im_end, endoftext]).save_pretrained(path)
        return path

    model = copy.deepcopy(small_model)
    rows = len(char_tokenizer) + 8
    model.resize_token_embeddings(rows)
    path = instruct_like(model, "spare_rows")
    rm = load_reward_model(path)
    assert rm.config.pad_token_id == len(char_tokenizer) < rows
    body = char_tokenizer.encode("\\boxed{2}", add_special_tokens=False)
    prompt = char_tokenizer.encode("1+1=?", add_special_tokens=False)
    ended, cut = score_sequences(rm, [prompt, prompt], [body + [endoftext], body], share_prompts=False)
    assert ended != cut  # the head reads the stop token, not the token before it
    shared = score_sequences(rm, [prompt] * 4, [body + [endoftext], body] * 2)
    assert torch.allclose(shared[:2], torch.stack([ended, cut]), atol=1e-5)
    # the course's checkpoint has no spare row, so the same generation config is refused, with the token named
    assert small_model.get_input_embeddings().num_embeddings == len(char_tokenizer)
    plain = instruct_like(small_model, "no_spare_row")
    with pytest.raises(ValueError, match=r"pads with <\|endoftext\|> \(id \d+\), a token replies end with"):
        load_reward_model(plain)
