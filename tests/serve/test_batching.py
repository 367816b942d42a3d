"""Concurrent sampling requests are served in one batched call, and each gets its own prompt's completions."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("tinker")

from edurl.serve.app import Backend  # noqa: E402
from edurl.serve.models import TINY_ARITHMETIC, ModelRegistry  # noqa: E402
from edurl.serve.wire import pb  # noqa: E402

QUESTIONS = ["12+34=?", "27+58=?", "90+9=?", "5+61=?", "33+33=?", "70+14=?"]


def request(backend, sampler_id, tokenizer, question, n=2, **params):
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    body = {
        "sampling_session_id": sampler_id,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "num_samples": n,
        "sampling_params": {"max_tokens": 12, "temperature": 0.0, **params},
    }
    return backend.asample(body)["request_id"]


def completions(backend, rid) -> list[list[int]]:
    raw = backend.futures[rid].result(timeout=120)
    assert isinstance(raw, bytes), raw
    out = pb.SampleResponse()
    out.ParseFromString(raw)
    return [np.frombuffer(s.tokens, dtype="<i4").tolist() for s in out.sequences]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    backend = Backend(ModelRegistry(device="cpu", progress=False), tmp_path_factory.mktemp("state"))
    session = backend.new_session()
    sampler_id = backend.create_sampling_session({"session_id": session, "base_model": TINY_ARITHMETIC})[
        "sampling_session_id"
    ]
    tokenizer = backend.samplers[sampler_id].client.tokenizer
    return backend, sampler_id, tokenizer


def test_queued_requests_share_one_call_and_keep_their_own_answers(served):
    backend, sampler_id, tokenizer = served
    alone = {q: completions(backend, request(backend, sampler_id, tokenizer, q)) for q in QUESTIONS}

    gate = threading.Event()
    backend.worker.submit(gate.wait)  # hold the worker while the requests queue up
    calls = backend.sample_calls
    rids = {q: request(backend, sampler_id, tokenizer, q) for q in QUESTIONS}
    gate.set()
    together = {q: completions(backend, rid) for q, rid in rids.items()}
    assert backend.sample_calls - calls == 1, "six queued requests with the same settings: one batched call"
    assert together == alone, "greedy completions are the same in a batch as alone, each under its own prompt"


def test_requests_that_trickle_in_are_still_batched_together(tmp_path, served):
    # the SDK's requests of one step arrive a few ms apart; a fixed 5 ms wait served the first few alone and
    # the rest in a second call, which doubled the step's sampling time
    _, _, tokenizer = served
    backend = Backend(ModelRegistry(device="cpu", progress=False), tmp_path, batch_window=0.025, max_batch_wait=2.0)
    session = backend.new_session()
    sampler_id = backend.create_sampling_session({"session_id": session, "base_model": TINY_ARITHMETIC})[
        "sampling_session_id"
    ]
    completions(backend, request(backend, sampler_id, tokenizer, QUESTIONS[0]))  # warm up
    calls = backend.sample_calls
    rids = []
    for q in QUESTIONS + QUESTIONS[:2]:  # 8 requests over about 80 ms, 10 ms apart
        rids.append(request(backend, sampler_id, tokenizer, q))
        time.sleep(0.01)
    assert all(len(completions(backend, rid)) == 2 for rid in rids)
    assert backend.sample_calls - calls == 1


def test_different_settings_and_seeded_requests_are_not_mixed(served):
    backend, sampler_id, tokenizer = served
    gate = threading.Event()
    backend.worker.submit(gate.wait)
    calls = backend.sample_calls
    rids = [
        request(backend, sampler_id, tokenizer, QUESTIONS[0]),
        request(backend, sampler_id, tokenizer, QUESTIONS[1]),
        request(backend, sampler_id, tokenizer, QUESTIONS[2], n=3),  # another group size
        request(backend, sampler_id, tokenizer, QUESTIONS[3], temperature=1.0, seed=1),  # alone
        request(backend, sampler_id, tokenizer, QUESTIONS[4], temperature=1.0, seed=1),  # alone
    ]
    gate.set()
    sizes = [len(completions(backend, rid)) for rid in rids]
    assert sizes == [2, 2, 3, 2, 2]
    assert backend.sample_calls - calls == 4


def test_a_silent_session_expires_and_takes_its_samplers_with_it(tmp_path):
    backend = Backend(ModelRegistry(device="cpu", progress=False), tmp_path, session_timeout=60.0)
    old = backend.new_session()
    sampler_id = backend.create_sampling_session({"session_id": old, "base_model": TINY_ARITHMETIC})[
        "sampling_session_id"
    ]
    backend.sessions[old].last_seen -= 61  # its client went quiet a minute ago
    fresh = backend.new_session()
    assert old not in backend.sessions and sampler_id not in backend.samplers
    assert fresh in backend.sessions


def test_a_bad_request_is_refused_alone_and_the_queue_it_joined_is_served(served):
    """An empty stop string raised inside the drain, after the queue was taken: every request queued with it
    waited for ever. A prompt id outside the vocabulary failed the whole batched call, and so every request in it.
    max_tokens=0 was read as unset (32 tokens). Each is now a 400 for its own request, at submit time."""
    from edurl.serve.app import UserError

    backend, sampler_id, tokenizer = served
    gate = threading.Event()
    backend.worker.submit(gate.wait)  # the good requests queue up behind the bad ones
    try:
        good = [request(backend, sampler_id, tokenizer, q) for q in QUESTIONS[:2]]
        with pytest.raises(ValueError, match="stop sequences must not be empty"):
            request(backend, sampler_id, tokenizer, QUESTIONS[2], stop="")
        body = {
            "sampling_session_id": sampler_id,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 10**6]}]},
            "sampling_params": {"max_tokens": 4},
        }
        with pytest.raises(ValueError, match="token id 1000000"):
            backend.asample(body)
        with pytest.raises(ValueError, match="max_tokens"):
            request(backend, sampler_id, tokenizer, QUESTIONS[2], max_tokens=0)
    finally:
        gate.set()  # a failure above must not leave the worker held (pytest would wait for it at exit)
    assert all(len(completions(backend, rid)) == 2 for rid in good)
    assert issubclass(UserError, ValueError)  # what the HTTP layer answers with a 400


def test_named_sampler_weights_go_with_their_session(tmp_path):
    """Each save_weights_for_sampler(name) keeps a full copy of the model; finish_session dropped the session's
    models and samplers but kept these, so a loop that names a save every step grew without bound."""
    backend = Backend(ModelRegistry(device="cpu", progress=False), tmp_path)
    session = backend.new_session()
    rid = backend.create_model({"session_id": session, "base_model": TINY_ARITHMETIC, "lora_config": {"rank": 4}})
    model_id = backend.futures[rid].result(timeout=120)["model_id"]
    other = backend.new_session()  # another client's named weights stay
    rid = backend.create_model({"session_id": other, "base_model": TINY_ARITHMETIC, "lora_config": {"rank": 4}})
    other_id = backend.futures[rid].result(timeout=120)["model_id"]
    for i, (mid, seq) in enumerate([(model_id, 1), (model_id, 2), (other_id, 1)]):
        rid = backend.save_weights_for_sampler({"model_id": mid, "seq_id": seq, "path": f"w{i}"})
        assert backend.futures[rid].result(timeout=120)["path"].startswith(f"tinker://{mid}/")
    assert len(backend.sampler_weights) == 3
    backend.finish_session(session)
    assert list(backend.sampler_weights) == [f"tinker://{other_id}/sampler_weights/w2"]


def test_two_saves_of_one_name_queued_together_are_not_both_accepted(tmp_path):
    """The 'exists' check ran at submit time and the write later, so a second save_state of the same name, sent
    before the first ran, was accepted and silently replaced it."""
    from edurl.serve.app import UserError

    backend = Backend(ModelRegistry(device="cpu", progress=False), tmp_path)
    session = backend.new_session()
    rid = backend.create_model({"session_id": session, "base_model": TINY_ARITHMETIC, "lora_config": {"rank": 4}})
    model_id = backend.futures[rid].result(timeout=120)["model_id"]
    gate = threading.Event()
    backend.worker.submit(gate.wait)  # the first save waits in the queue
    try:
        first = backend.save_weights({"model_id": model_id, "seq_id": 1, "path": "twice"})
        assert backend.save_weights({"model_id": model_id, "seq_id": 1, "path": "twice"}) == first  # a resend
        with pytest.raises(UserError, match="exists"):
            backend.save_weights({"model_id": model_id, "seq_id": 2, "path": "twice"})
    finally:
        gate.set()
    assert backend.futures[first].result(timeout=120)["path"].endswith("/weights/twice")
    third = backend.save_weights({"model_id": model_id, "seq_id": 3, "path": "twice", "overwrite": True})
    assert backend.futures[third].result(timeout=120)["path"].endswith("/weights/twice")
