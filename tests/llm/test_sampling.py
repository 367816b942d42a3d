import pytest
import torch

from edurl.llm.evaluation import sequence_logprobs
from edurl.llm.sampling import PrefixCache, SamplingParams, sample

TEXTS = ["12+34=?", "a much longer prompt, 99-17=?", "x"]  # three different prompt lengths


def _prompts(tok):
    return [tok.encode(t, add_special_tokens=False) for t in TEXTS]


def _recomputed(model, prompt, completion, temperature):
    """log-softmax(logits / T) of each completion token, from one unpadded forward pass."""
    tokens = torch.tensor([prompt + completion])
    lp = sequence_logprobs(model, tokens, temperature=temperature)[0]  # (n-1,)
    return lp[len(prompt) - 1 :]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_logprobs_match_recomputed_log_softmax(small_model, char_tokenizer, temperature):
    prompts = _prompts(char_tokenizer)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=0)
    out = sample(small_model, prompts, num_samples=4, params=params, pad_token_id=char_tokenizer.pad_token_id)
    assert len(out) == 12 and [c.prompt_index for c in out] == [0] * 4 + [1] * 4 + [2] * 4
    for c in out:
        ref = _recomputed(small_model, prompts[c.prompt_index], c.tokens, temperature)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (c, ref)


def test_padding_does_not_change_a_prompts_samples(small_model, char_tokenizer):
    """Greedy continuations are the same alone and in a batch with longer prompts."""
    prompts = _prompts(char_tokenizer)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    batch = sample(small_model, prompts, 1, params, pad_token_id=char_tokenizer.pad_token_id)
    for i, p in enumerate(prompts):
        alone = sample(small_model, [p], 1, params, pad_token_id=char_tokenizer.pad_token_id)[0]
        assert batch[i].tokens == alone.tokens
        assert batch[i].logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_greedy_is_argmax_and_reports_logprobs(small_model, char_tokenizer):
    prompt = _prompts(char_tokenizer)[0]
    out = sample(small_model, [prompt], 2, SamplingParams(max_tokens=8, temperature=0.0))
    assert out[0].tokens == out[1].tokens
    tokens = prompt[:]
    for tok, lp in zip(out[0].tokens, out[0].logprobs):
        logits = small_model(torch.tensor([tokens])).logits[0, -1]
        assert tok == logits.argmax().item()
        assert lp == pytest.approx(torch.log_softmax(logits, -1)[tok].item(), abs=1e-4)
        tokens.append(tok)


def test_stop_sequences_end_completions(small_model, char_tokenizer):
    prompts = _prompts(char_tokenizer)
    free = sample(small_model, prompts, 8, SamplingParams(max_tokens=12, seed=1), eos_token_id=[])
    assert all(c.stop_reason == "length" and len(c.tokens) == 12 for c in free)
    stop_tok = free[0].tokens[2]  # a token we know gets sampled
    out = sample(small_model, prompts, 8, SamplingParams(max_tokens=12, seed=1, stop=[stop_tok]), eos_token_id=[])
    stopped = [c for c in out if c.stop_reason == "stop"]
    assert stopped
    for c in out:
        assert len(c.logprobs) == len(c.tokens)
        if c.stop_reason == "stop":
            assert c.tokens[-1] == stop_tok and stop_tok not in c.tokens[:-1]
        else:
            assert stop_tok not in c.tokens and len(c.tokens) == 12
    # the same seed gives the same draws up to the stop
    assert out[0].tokens == free[0].tokens[: len(out[0].tokens)]
    # a two-token stop sequence
    pair = free[0].tokens[3:5]
    two = sample(small_model, prompts, 8, SamplingParams(max_tokens=12, seed=1, stop=[pair]), eos_token_id=[])
    assert two[0].stop_reason == "stop" and two[0].tokens[-2:] == pair


def test_seeded_draws_are_reproducible_and_diverse(small_model, char_tokenizer):
    prompts = _prompts(char_tokenizer)
    a = sample(small_model, prompts, 6, SamplingParams(max_tokens=6, seed=3))
    b = sample(small_model, prompts, 6, SamplingParams(max_tokens=6, seed=3))
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert len({tuple(c.tokens) for c in a[:6]}) > 1  # a random model's samples differ within a group


def test_top_p_keeps_only_the_nucleus(small_model, char_tokenizer):
    prompt = _prompts(char_tokenizer)[0]
    probs = torch.softmax(small_model(torch.tensor([prompt])).logits[0, -1], -1)
    top = probs.argmax().item()
    out = sample(small_model, [prompt], 50, SamplingParams(max_tokens=1, top_p=1e-6, seed=0))
    assert {c.tokens[0] for c in out} == {top}


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([[]], {}, "prompt 0 is empty"),
        ([], {}, "non-empty list"),
        ([[1, 2]], {"num_samples": 0}, "num_samples"),
    ],
)
def test_bad_inputs_are_explained(small_model, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample(small_model, prompts, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.cuda
def test_sampler_on_cuda(char_tokenizer):
    from edurl.llm.model import build_tiny_lm

    from .conftest import SMALL

    model = build_tiny_lm(char_tokenizer, SMALL).to("cuda")
    prompts = _prompts(char_tokenizer)
    out = sample(model, prompts, 4, SamplingParams(max_tokens=10, temperature=0.8, seed=0))
    for c in out:
        ref = _recomputed(model, prompts[c.prompt_index], c.tokens, 0.8).cpu()
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)


def test_a_models_own_eos_ends_a_completion(small_model, char_tokenizer):
    # a real chat model whose EOS is not the renderer's stop token: the old sampler ran on to max_tokens
    import copy

    prompts = _prompts(char_tokenizer)[:1]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    first = sample(small_model, prompts, 1, greedy, eos_token_id=[])[0].tokens[0]
    model = copy.deepcopy(small_model)
    model.generation_config.eos_token_id = first  # the model declares the token it emits first as its EOS
    out = sample(model, prompts, 1, greedy)[0]
    assert out.tokens == [first] and out.stop_reason == "stop"
    assert len(sample(model, prompts, 1, greedy, eos_token_id=[])[0].tokens) == 8  # opting out
    assert sample(small_model, prompts, 1, greedy, eos_token_id=first)[0].tokens == [first]


def test_the_kv_cache_is_passed_under_the_installed_transformers_name(small_model, char_tokenizer):
    """transformers 5.x deprecates forward's ``past_key_values`` (gone in 5.40) for ``cache``: the sampler and the
    shared-prompt scorer must use whichever the installed version takes, so neither warns (nor, later, breaks)."""
    import warnings

    from edurl.llm.shared_prefix import token_logprobs

    prompts = _prompts(char_tokenizer)
    rows = [prompts[1] + [5, 6], prompts[1] + [7]]
    ids = torch.tensor([r + [0] * (len(rows[0]) - len(r)) for r in rows])
    attn = (torch.arange(ids.shape[1])[None] < torch.tensor([[len(r)] for r in rows])).long()
    mask = torch.zeros(ids.shape)
    mask[:, len(prompts[1]) - 1 :] = 1.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sample(small_model, prompts, 2, SamplingParams(max_tokens=4, seed=0), pad_token_id=char_tokenizer.pad_token_id)
        token_logprobs(small_model, ids, attn, torch.roll(ids, -1, 1), mask * attn, model_config=small_model.config)
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]


def _two_turns(model, tok, prefix_cache, extend):
    """Turn 1 on _prompts, then turn 2 on ``extend(prompts, turn-1 completions)``. Returns (turn 1, turn-2 prompts,
    turn 2)."""
    pad_id = tok.pad_token_id
    prompts = _prompts(tok)
    keys = list(range(len(prompts))) if prefix_cache is not None else None
    first = sample(model, prompts, 1, SamplingParams(max_tokens=6, seed=1), pad_id, None, prefix_cache, keys)
    second = extend(prompts, first)
    out = sample(model, second, 1, SamplingParams(max_tokens=8, seed=2), pad_id, None, prefix_cache, keys)
    return first, second, out


def _answered(tok):
    """``extend`` for _two_turns: each conversation grows by its reply and an answer of a different length."""
    answer = tok.encode(" lower. again:", add_special_tokens=False)

    def extend(prompts, first):
        return [p + c.tokens + answer[: 3 + 4 * i] for i, (p, c) in enumerate(zip(prompts, first))]

    return extend


def test_a_prefix_cache_gives_the_draws_of_a_whole_prefill(small_model, char_tokenizer):
    """Turn 2 run on turn 1's cached keys and values draws what a sampler without the cache draws."""
    extend = _answered(char_tokenizer)
    cache = PrefixCache()
    first, second, cached = _two_turns(small_model, char_tokenizer, cache, extend)
    _, second_whole, whole = _two_turns(small_model, char_tokenizer, None, extend)
    assert second == second_whole  # turn 1 drew the same replies
    assert (cache.hits, cache.misses, len(cache)) == (3, 0, 3)
    # each prompt's turn-1 tokens and all of its reply but the last token were not run again
    assert cache.saved_tokens == sum(len(p) + len(c.tokens) - 1 for p, c in zip(_prompts(char_tokenizer), first))
    for prompt, a, b in zip(second, cached, whole, strict=True):
        assert a.tokens == b.tokens and a.stop_reason == b.stop_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        # and both are the log-softmax of one unpadded forward pass over the whole conversation
        assert torch.allclose(torch.tensor(a.logprobs), _recomputed(small_model, prompt, a.tokens, 1.0), atol=1e-4)


@pytest.mark.cuda
def test_a_prefix_cache_on_cuda_matches_a_whole_forward_pass(char_tokenizer):
    """On a GPU the cached turn's draws can differ from an uncached sampler's by rounding, so check what must hold:
    every hit, and each drawn token's log-prob equal to one unpadded forward pass over the whole conversation."""
    from edurl.llm.model import build_tiny_lm

    from .conftest import SMALL

    model = build_tiny_lm(char_tokenizer, SMALL).to("cuda")
    cache = PrefixCache()
    _, second, cached = _two_turns(model, char_tokenizer, cache, _answered(char_tokenizer))
    assert (cache.hits, cache.misses) == (3, 0)
    assert all(kv[0][0].device.type == "cuda" for _, kv in cache.entries.values())
    for prompt, c in zip(second, cached, strict=True):
        ref = _recomputed(model, prompt, c.tokens, 1.0).cpu()
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)


def test_a_prompt_that_does_not_extend_its_cached_turn_is_prefilled_whole(small_model, char_tokenizer):
    """A renderer that re-encodes earlier turns differently: the cache is not used for that row."""
    answer = char_tokenizer.encode(" higher", add_special_tokens=False)

    def rewrite_first(prompts, first):  # row 0's history changes its first token; rows 1 and 2 extend theirs
        rows = [p + c.tokens + answer for p, c in zip(prompts, first)]
        rows[0] = [rows[0][1]] + rows[0][1:]
        return rows

    cache = PrefixCache()
    _, second, cached = _two_turns(small_model, char_tokenizer, cache, rewrite_first)
    _, _, whole = _two_turns(small_model, char_tokenizer, None, rewrite_first)
    assert (cache.hits, cache.misses) == (2, 1)
    for a, b in zip(cached, whole, strict=True):
        assert a.tokens == b.tokens and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cache_keys": None}, "one cache key per prompt"),
        ({"cache_keys": [0, 1]}, "one cache key per prompt"),
        ({"cache_keys": [0, 1, 2], "num_samples": 2}, "num_samples must be 1"),
    ],
)
def test_prefix_cache_inputs_are_checked(small_model, char_tokenizer, kwargs, match):
    kwargs = {"num_samples": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        sample(
            small_model,
            _prompts(char_tokenizer),
            params=SamplingParams(max_tokens=2),
            prefix_cache=PrefixCache(),
            **kwargs,
        )


def test_a_prompt_id_outside_the_models_vocabulary_is_named(small_model, char_tokenizer):
    """A prompt encoded with another tokenizer than the model's: an IndexError from the embedding before."""
    vocab = small_model.get_input_embeddings().num_embeddings
    good = _prompts(char_tokenizer)[0]
    with pytest.raises(ValueError, match=f"prompt 1 holds token id {vocab}.*another tokenizer"):
        sample(small_model, [good, good[:2] + [vocab]], 1, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="token id -1"):
        sample(small_model, [[-1] + good], 1, SamplingParams(max_tokens=2))


def test_a_sample_past_the_models_positions_warns_once_per_setting(small_model, char_tokenizer):
    """Rotary positions compute past max_position_embeddings without an error, so a prompt plus max_tokens longer
    than the model ever trained on sampled silently."""
    import warnings

    limit = small_model.config.max_position_embeddings
    fits, past = [1] * (limit - 4), [1] * (limit - 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sample(small_model, [fits], 1, SamplingParams(max_tokens=4, seed=0))  # ends at the last trained position
    with pytest.warns(
        UserWarning, match=rf"max_tokens=4 can reach past the model's max_position_embeddings \({limit}\)"
    ) as record:
        sample(small_model, [fits, past], 1, SamplingParams(max_tokens=4, seed=0))
    assert record[0].filename == __file__  # at this call, not in torch.no_grad's wrapper around sample
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # Python's own: once per text and line
        for n in (3, 2, 1):  # prompts of other lengths in a loop: the same text, so one warning
            sample(small_model, [[1] * (limit - n)], 1, SamplingParams(max_tokens=4, seed=0))
    assert len(seen) == 1 and "TinyLMConfig(max_position_embeddings=...)" in str(seen[0].message)


def test_a_vanishing_temperature_is_refused_in_favour_of_greedy():
    """Below ~1e-36, logits / temperature overflowed and torch.multinomial failed on NaN probabilities."""
    with pytest.raises(ValueError, match="temperature=0 for greedy"):
        SamplingParams(temperature=1e-39)
    SamplingParams(temperature=1e-3)


def test_an_adapted_embedding_still_samples_and_trains(small_model, char_tokenizer):
    """peft's LoRA on embed_tokens wraps the embedding in a module without num_embeddings; the vocabulary checks
    read it from there, and both sample and forward_backward failed with an AttributeError."""
    import copy

    pytest.importorskip("peft")
    from edurl.llm.clients import TrainingClient
    from edurl.llm.datum import build_datum
    from edurl.llm.policy import LoraSettings, wrap_lora
    from edurl.llm.sampling import embedding_rows

    model = wrap_lora(copy.deepcopy(small_model), LoraSettings(rank=4, target_modules=("embed_tokens", "q_proj")))
    vocab = small_model.get_input_embeddings().num_embeddings
    assert embedding_rows(model) == vocab
    prompt = _prompts(char_tokenizer)[0]
    (c,) = sample(model, [prompt], 1, SamplingParams(max_tokens=4, seed=0), eos_token_id=[])
    with pytest.raises(ValueError, match=f"token id {vocab}"):
        sample(model, [prompt + [vocab]], 1, SamplingParams(max_tokens=2))
    trainer = TrainingClient(model, char_tokenizer)
    out = trainer.forward_backward([build_datum(prompt, c.tokens, c.logprobs, 1.0)], "importance_sampling").result()
    assert out.loss == out.loss  # finite, not an AttributeError


def test_the_prefix_cache_refuses_a_sliding_window_model_with_the_reason():
    """Its cache keeps only the last window of keys, and keep_kv masked it with the full-length mask: an IndexError
    from inside the cache code. Plain sampling of the same model is right, so it still works."""
    from .conftest import random_llama_family

    model = random_llama_family("qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=0)
    prompts, params = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7]], SamplingParams(max_tokens=4, seed=0)
    with pytest.raises(ValueError, match="sliding-window attention layers.*prefix_cache=None"):
        sample(model, prompts, 1, params, prefix_cache=PrefixCache(), cache_keys=[0, 1])
    assert [len(c.tokens) for c in sample(model, prompts, 1, params, eos_token_id=[])] == [4, 4]
    # Mistral's configs say it with sliding_window alone (no layer_types, no use_sliding_window)
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    mistral = MistralForCausalLM(
        MistralConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, sliding_window=6, pad_token_id=0)
    ).eval()  # fmt: skip
    if getattr(mistral.config, "layer_types", None) is None:
        with pytest.raises(ValueError, match="sliding-window attention layers"):
            sample(mistral, prompts, 1, params, prefix_cache=PrefixCache(), cache_keys=[0, 1])


def test_sampling_params_say_what_is_wrong_with_the_stop_and_the_budget():
    # stop="ab" failed with "too many dimensions 'str'" and stop=[5.0] with "'float' object is not iterable"
    import numpy as np

    for stop in ("ab", [5.0], [[1, "x"]], 7):
        with pytest.raises(TypeError, match="stop must be a list of token ids or of token-id sequences"):
            SamplingParams(stop=stop)
    assert SamplingParams(stop=[np.int64(5), [1, 2]]).stop_sequences() == [[5], [1, 2]]
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        SamplingParams(max_tokens=True)
    with pytest.raises(ValueError, match="temperature must be >= 0 and finite"):
        SamplingParams(temperature=float("inf"))
