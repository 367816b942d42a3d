"""A bounded load test on loopback: 8 SDK clients sample concurrently for 30 s. No request fails, no session
outlives its client, and the server's memory stays level."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from edurl.serve.launch import LocalServer  # noqa: E402

from .conftest import KEY  # noqa: E402

CLIENTS = 8
SECONDS = 30.0


def stats(url: str) -> dict:
    return httpx.get(f"{url}/api/v1/edurl/stats", headers={"X-API-Key": KEY}, timeout=30).json()


@pytest.fixture(scope="module")
def own_server(tmp_path_factory):
    """A server of this test's own: on the shared one, sessions that other tests' clients left open expire
    while this test runs (after 600 s without a heartbeat), and the count of sessions fell under it."""
    log = tmp_path_factory.mktemp("serve-load") / "serve.log"
    with LocalServer(device="cpu", api_key=KEY, log=str(log)) as server:
        yield server.url


def test_eight_clients_sample_for_thirty_seconds(own_server):
    server_url = own_server
    prompt = types.ModelInput.from_ints([1, 2, 3, 4])
    params = types.SamplingParams(max_tokens=8, temperature=1.0)
    before = stats(server_url)
    assert before["sessions"] == 0, before
    # warm-up: the base model loaded and one round of sampling done, so memory is measured at steady state
    warm = tinker.ServiceClient(base_url=server_url, api_key=KEY)
    warm.create_sampling_client(base_model="edurl/tiny-arithmetic").sample(prompt, 2, params).result()
    warm.close("success").result()
    rss_start = stats(server_url)["rss_bytes"]

    done, failures = [], []
    deadline = time.monotonic() + SECONDS

    def client(k: int) -> None:
        service = tinker.ServiceClient(base_url=server_url, api_key=KEY)
        try:
            sampler = service.create_sampling_client(base_model="edurl/tiny-arithmetic")
            while time.monotonic() < deadline:
                try:
                    res = sampler.sample(prompt, 2, params).result(timeout=120)
                    assert len(res.sequences) == 2
                    done.append(k)
                except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                    failures.append(f"client {k}: {type(exc).__name__}: {exc}")
        finally:
            service.close("success").result()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=SECONDS + 180)
    after = stats(server_url)

    assert failures == [], failures[:3]
    assert len(set(done)) == CLIENTS and len(done) >= CLIENTS, f"only {len(done)} samples from {len(set(done))} clients"
    assert after["sessions"] == before["sessions"], f"sessions leaked: {before['sessions']} -> {after['sessions']}"
    assert after["samplers"] == before["samplers"]
    grown = after["rss_bytes"] - rss_start
    assert grown < 200 * 2**20, f"server memory grew by {grown / 2**20:.0f} MiB over {len(done)} samples"
    assert after["sample_calls"] - before["sample_calls"] < len(done), (
        "no two concurrent requests were ever served in one batched call"
    )
