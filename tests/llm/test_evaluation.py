import copy

import pytest
import torch

from edurl.llm.evaluation import evaluate, sequence_logprobs
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.tasks import ArithmeticTask


def test_sequence_logprobs_by_hand(small_model, char_tokenizer):
    tokens = torch.tensor([char_tokenizer.encode("7+5=12")])
    out = sequence_logprobs(small_model, tokens)
    logits = small_model(input_ids=tokens).logits.float()
    for t in range(tokens.shape[1] - 1):
        expected = torch.log_softmax(logits[0, t], -1)[tokens[0, t + 1]]
        assert out[0, t].item() == pytest.approx(expected.item(), abs=1e-5)
    hot = sequence_logprobs(small_model, tokens, temperature=0.5)
    assert hot.shape == out.shape and not torch.allclose(hot, out)
    # temperature 0 is greedy, whose draws the sampler reports at temperature 1; it was NaN (logits / 0)
    assert torch.equal(sequence_logprobs(small_model, tokens, temperature=0), out)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sequence_logprobs(small_model, tokens, temperature=-1.0)


def test_a_float64_model_scores_and_samples_in_float64(small_model, char_tokenizer):
    """Log-probs were cast to float32 whatever the model's dtype, which capped float64 gradient checks at ~1e-7."""
    from edurl.llm.sampling import SamplingParams, sample

    model = copy.deepcopy(small_model).double()
    tokens = torch.tensor([char_tokenizer.encode("7+5=12")])
    out = sequence_logprobs(model, tokens)
    assert out.dtype == torch.float64
    logits = model(input_ids=tokens).logits[0]
    expected = torch.log_softmax(logits[:-1], -1).gather(-1, tokens[0, 1:, None]).squeeze(-1)
    assert torch.allclose(out[0], expected, rtol=0, atol=1e-12)
    prompt = char_tokenizer.encode("7+5=", add_special_tokens=False)
    for c in sample(model, [prompt], 2, SamplingParams(max_tokens=4, seed=0), eos_token_id=[]):
        scored = sequence_logprobs(model, torch.tensor([prompt + c.tokens]))[0, len(prompt) - 1 :]
        assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), scored, rtol=0, atol=1e-10)


def test_an_untrained_model_scores_near_zero_and_keeps_samples(small_model, char_tokenizer):
    renderer = ChatMLRenderer(char_tokenizer)
    problems = ArithmeticTask().sample(6, split="test", seed=0)
    result = evaluate(small_model, renderer, problems, max_tokens=6, keep_samples=2)
    assert result.pass_at_1 == 0.0 and 0.0 <= result.format <= 1.0
    assert len(result.samples) == 2 and result.samples[0][0] == problems[0].question
    assert result.samples[0][2] == problems[0].answer


def test_sampled_batches_draw_their_own_randomness(small_model, char_tokenizer):
    """One seed for every batch gave row i of each batch the same draws: at batch_size=1 every problem got one
    random stream, and 8 copies of a problem got 8 copies of one reply."""
    renderer = ChatMLRenderer(char_tokenizer)
    problems = ArithmeticTask().sample(1, split="test", seed=0) * 8
    replies = {}
    for batch_size in (1, 8):
        result = evaluate(small_model, renderer, problems, temperature=1.5, max_tokens=6, batch_size=batch_size)
        replies[batch_size] = [reply for _, reply, _ in result.samples]
    assert len(set(replies[1])) > 4 and len(set(replies[8])) > 4, replies
    # greedy: as before. In float64, so that a near tie of two logits cannot flip between batch shapes on another CPU
    model64 = copy.deepcopy(small_model).double()
    greedy = [evaluate(model64, renderer, problems, max_tokens=6, batch_size=b).samples for b in (1, 8)]
    assert greedy[0] == greedy[1] and len({reply for _, reply, _ in greedy[0]}) == 1


def test_an_empty_problem_list_is_refused(small_model, char_tokenizer):
    with pytest.raises(ValueError, match="problems is empty"):
        evaluate(small_model, ChatMLRenderer(char_tokenizer), [])


def test_an_empty_or_negative_batch_size_is_refused(small_model, char_tokenizer):
    problems = ArithmeticTask().sample(2, split="test", seed=0)
    for bad in (-1, 0):  # -1 sampled nothing and reported 0 % pass@1; 0 raised range()'s own error
        with pytest.raises(ValueError, match="batch_size must be a whole number"):
            evaluate(small_model, ChatMLRenderer(char_tokenizer), problems, batch_size=bad)


def test_a_temperature_too_small_to_divide_by_is_refused(small_model, char_tokenizer):
    tokens = torch.tensor([char_tokenizer.encode("7+5=12")])
    with pytest.raises(ValueError, match="greedy in all but name"):  # 1e-40 gave NaN log-probs
        sequence_logprobs(small_model, tokens, temperature=1e-40)


def test_a_left_padded_row_scores_as_it_does_alone_with_absolute_positions():
    # GPT-2 adds a learned embedding per position: a left-padded row, read at positions counted from its padding,
    # was off by up to 0.2 nats; the sampler pads on the left, so its rows are laid out this way
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=20, n_positions=16, n_embd=16, n_layer=1, n_head=2)).eval()
    row = torch.tensor([[5, 6, 7, 8]])
    padded = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        alone, both = sequence_logprobs(model, row), sequence_logprobs(model, padded, mask)
    assert torch.allclose(both[0, 2:], alone[0], atol=1e-6)
    assert torch.equal(both[1], sequence_logprobs(model, padded[1:])[0])  # a row without padding: unchanged


def test_evaluate_warns_when_max_tokens_cuts_the_reference_replies(small_model, char_tokenizer):
    # 9-digit sums' replies take up to 19 tokens: the default 16 graded them as cut off and wrong, without a word
    renderer = ChatMLRenderer(char_tokenizer)
    problems = ArithmeticTask(9).sample(4, split="test", seed=0)
    with pytest.warns(
        UserWarning, match=r"max_tokens=16 cuts off \d+ of 4 of the problems' reference replies .*max_tokens >= \d+"
    ) as record:
        evaluate(small_model, renderer, problems, max_tokens=16)
    assert record[0].filename == __file__  # it points at the call to evaluate, not into the library
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluate(small_model, renderer, ArithmeticTask(2).sample(4, split="test", seed=0), max_tokens=16)

    # a problem of the learner's own kind, with no reference reply to measure, is evaluated without the check
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Mine:
        question: str
        answer: str

        def messages(self):
            return [{"role": "user", "content": self.question}]

    assert evaluate(small_model, renderer, [Mine("12+34=?", "46")], max_tokens=4).pass_at_1 == 0.0
