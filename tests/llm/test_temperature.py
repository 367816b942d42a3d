import pytest
import torch

from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.tasks import ArithmeticTask
from edurl.llm.temperature import (
    group_diversity,
    next_token_distribution,
    plot_group_diversity,
    plot_next_token_distribution,
)


def test_next_token_distribution(small_model, char_tokenizer):
    prompt = char_tokenizer.encode("12+34=?", add_special_tokens=False)
    logits = small_model(torch.tensor([prompt])).logits[0, -1]
    for t in (0.5, 1.0, 2.0):
        p = next_token_distribution(small_model, prompt, t)
        assert torch.allclose(p, torch.softmax(logits / t, -1), atol=1e-6)
    greedy = next_token_distribution(small_model, prompt, 0)
    assert greedy.sum() == 1 and greedy[logits.argmax()] == 1
    # higher temperature, higher entropy
    ent = [-(p * p.log()).sum() for p in (next_token_distribution(small_model, prompt, t) for t in (0.5, 1, 2))]
    assert ent[0] < ent[1] < ent[2]
    plot_next_token_distribution(next_token_distribution(small_model, prompt), char_tokenizer)


def test_next_token_distribution_refuses_what_the_sampler_refuses(small_model, char_tokenizer):
    prompt = char_tokenizer.encode("12+34=?", add_special_tokens=False)
    with pytest.raises(ValueError, match="temperature must be >= 0"):  # -1 gave the inverted distribution
        next_token_distribution(small_model, prompt, -1.0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        next_token_distribution(small_model, prompt, float("nan"))
    with pytest.raises(ValueError, match="prompt_ids is empty"):  # was an embedding's dtype error
        next_token_distribution(small_model, [], 1.0)


def test_group_diversity_is_one_answer_when_greedy(small_model, char_tokenizer):
    r = ChatMLRenderer(char_tokenizer)
    problems = ArithmeticTask(1).sample(6)
    table = group_diversity(small_model, r, problems, [0.0, 2.0], group_size=4, max_tokens=6, progress=False)
    assert list(table.columns) == ["temperature", "distinct_answers", "correct", "frac_mixed"]
    greedy, hot = table.iloc[0], table.iloc[1]
    assert greedy.distinct_answers == 1.0 and greedy.frac_mixed == 0.0
    assert 1.0 <= hot.distinct_answers <= 4.0
    plot_group_diversity(table, group_size=4)
