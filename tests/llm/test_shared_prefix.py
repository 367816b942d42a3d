import pytest
import torch

from edurl.llm.padding import pad
from edurl.llm.shared_prefix import scaled_log_softmax, token_logprobs


def batch(rows, masks):
    ids, attn = pad(rows, 0)
    targets = torch.roll(ids, -1, dims=1) * attn  # any fixed targets: the test compares two ways to score them
    mask = pad(masks, 0, dtype=torch.float32, length=ids.shape[1])[0]
    return ids, attn, targets, mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_shared_prompt_scores_what_whole_rows_score(small_model, temperature):
    prompt_a, prompt_b = [3, 35, 33, 19, 32, 100], [3, 35, 9]
    rows = [prompt_a + [7, 8, 9], prompt_b + [4], prompt_a + [10, 11], prompt_b + [12, 13, 14, 15]]
    masks = [
        [0] * (len(prompt_a) - 1) + [1] * 4,
        [0] * (len(prompt_b) - 1) + [1] * 2,
        [0] * (len(prompt_a) - 1) + [1] * 3,
        [0] * (len(prompt_b) - 1) + [1] * 5,
    ]
    ids, attn, targets, mask = batch(rows, masks)
    kw = dict(temperature=temperature, with_entropy=True, model_config=small_model.config)
    shared = token_logprobs(small_model, ids, attn, targets, mask, share_prompts=True, **kw)
    whole = token_logprobs(small_model, ids, attn, targets, mask, share_prompts=False, **kw)
    keep = attn.bool()
    for a, b in zip(shared, whole):
        assert torch.allclose(a[keep], b[keep], atol=1e-5)
        assert (a[~keep] == 0).all()


def test_the_gradient_through_the_shared_prompt_matches_whole_rows(small_model):
    rows = [[3, 35, 33, 19, 5, 6], [3, 35, 33, 19, 7], [3, 35, 33, 19, 8, 9, 10]]
    masks = [[0, 0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1, 1, 1]]
    ids, attn, targets, mask = batch(rows, masks)
    grads = []
    for share in (True, False):
        small_model.zero_grad()
        lp, _ = token_logprobs(
            small_model, ids, attn, targets, mask, share_prompts=share, model_config=small_model.config
        )
        (lp * mask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in small_model.named_parameters() if p.grad is not None})
    small_model.zero_grad()
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-5), name


def test_distinct_prompts_fall_back_to_whole_rows(small_model):
    calls = []

    def forward(**inputs):
        calls.append(inputs["input_ids"].shape)
        return small_model(**inputs)

    ids, attn, targets, mask = batch([[3, 4, 5, 6], [7, 8, 9]], [[0, 1, 1], [0, 1]])
    token_logprobs(forward, ids, attn, targets, mask, model_config=small_model.config)
    assert calls == [ids.shape]  # one pass over whole rows: two prompts for two rows would not pay


def test_scaled_log_softmax_treats_temperature_zero_as_one():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    assert torch.allclose(scaled_log_softmax(logits, 0), torch.log_softmax(logits, -1))
    assert torch.allclose(scaled_log_softmax(logits, 0.5), torch.log_softmax(logits / 0.5, -1))
