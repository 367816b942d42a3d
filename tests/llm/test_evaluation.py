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


def test_an_untrained_model_scores_near_zero_and_keeps_samples(small_model, char_tokenizer):
    renderer = ChatMLRenderer(char_tokenizer)
    problems = ArithmeticTask().sample(6, split="test", seed=0)
    result = evaluate(small_model, renderer, problems, max_tokens=6, keep_samples=2)
    assert result.pass_at_1 == 0.0 and 0.0 <= result.format <= 1.0
    assert len(result.samples) == 2 and result.samples[0][0] == problems[0].question
    assert result.samples[0][2] == problems[0].answer


def test_an_empty_problem_list_is_refused(small_model, char_tokenizer):
    with pytest.raises(ValueError, match="problems is empty"):
        evaluate(small_model, ChatMLRenderer(char_tokenizer), [])
