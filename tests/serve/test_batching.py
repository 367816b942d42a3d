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
