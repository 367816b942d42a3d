"""What edurl.serve refuses when a request arrives, or at startup, rather than failing later and taking a model (or
a learner's gradients, or a temporary folder) with it."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from edurl.serve.app import Backend, UserError, _safe  # noqa: E402
from edurl.serve.models import TINY_ARITHMETIC, ModelRegistry  # noqa: E402

KEY = "tml-refusals-key"


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return Backend(ModelRegistry(device="cpu", progress=False), tmp_path_factory.mktemp("state"))


def new_model(backend) -> str:
    session = backend.new_session()
    rid = backend.create_model({"session_id": session, "base_model": TINY_ARITHMETIC, "lora_config": {"rank": 4}})
    return backend.futures[rid].result(timeout=120)["model_id"]


def result(backend, rid):
    return backend.futures[rid].result(timeout=120)


def test_a_checkpoint_name_too_long_for_the_file_system_is_refused_when_sent(backend):
    """A 300-character name passed the submit-time checks; the write then failed in the worker (ENAMETOOLONG),
    which marked the model broken: every later operation failed, and the weights could no longer be saved."""
    model_id = new_model(backend)
    with pytest.raises(UserError, match="at most 255 bytes"):
        backend.save_weights({"model_id": model_id, "seq_id": 1, "path": "a" * 300})
    with pytest.raises(UserError, match="at most 255 bytes"):  # bytes, not characters: 'é' is 2 in UTF-8
        backend.save_weights({"model_id": model_id, "seq_id": 2, "path": "é" * 128})
    assert result(backend, backend.save_weights({"model_id": model_id, "seq_id": 3, "path": "a" * 255}))["path"]
    assert backend.models[model_id].broken is None


def test_a_save_that_cannot_write_fails_alone_and_the_model_keeps_working(backend):
    model_id = new_model(backend)
    m = backend.models[model_id]
    in_the_way = backend.state_dir / _safe(model_id) / "checkpoints"
    in_the_way.parent.mkdir(parents=True, exist_ok=True)
    in_the_way.write_text("a file where the checkpoints folder belongs\n")
    out = result(backend, backend.save_weights({"model_id": model_id, "seq_id": 1, "path": "first"}))
    assert "could not write" in out["error"] and "which is a file" in out["error"], out
    assert "log_dir" not in out["error"], out  # the in-process client's advice, which an HTTP client cannot follow
    assert m.broken is None
    in_the_way.unlink()
    out = result(backend, backend.save_weights({"model_id": model_id, "seq_id": 2, "path": "first"}))
    assert out["path"].endswith("/weights/first"), out  # the name is free again, and the save works


def test_loading_a_checkpoint_name_too_long_is_a_400_not_a_500(backend):
    """(folder / "state.pt").exists() raised OSError (ENAMETOOLONG): HTTP 500, which the SDK retried for ever."""
    model_id = new_model(backend)
    assert "error" not in result(backend, backend.save_weights({"model_id": model_id, "seq_id": 1, "path": "x"}))
    long_path = f"tinker://{model_id}/weights/" + "b" * 300
    with pytest.raises(UserError, match="no checkpoint at"):
        backend.load_weights({"model_id": model_id, "seq_id": 2, "path": long_path, "optimizer": False})
    session = backend.models[model_id].session_id
    with pytest.raises(UserError, match="no checkpoint at"):  # create_training_client_from_state
        backend.load_weights({"session_id": session, "path": long_path, "optimizer": False})
    out = result(
        backend,
        backend.load_weights(
            {"model_id": model_id, "seq_id": 3, "path": f"tinker://{model_id}/weights/x", "optimizer": False}
        ),
    )
    assert out["type"] == "load_weights", out


def test_create_model_ids_are_taken_when_sent_and_a_resend_never_rebuilds_the_model(backend):
    """Two create_model requests without model_seq_id, sent back to back, both read len(session.models) before
    the worker had added the first, got one id, and the second model replaced the first. A resent model_seq_id
    built a fresh model over the one in use."""
    session = backend.new_session()
    body = {"session_id": session, "base_model": TINY_ARITHMETIC, "lora_config": {"rank": 4}}
    gate = threading.Event()
    backend.worker.submit(gate.wait)  # both requests arrive before the worker builds either
    try:
        first, second = backend.create_model(dict(body)), backend.create_model(dict(body))
    finally:
        gate.set()
    ids = {result(backend, first)["model_id"], result(backend, second)["model_id"]}
    assert len(ids) == 2 and ids <= set(backend.models), ids

    explicit = {**body, "model_seq_id": 7}
    rid = backend.create_model(explicit)
    model_id = result(backend, rid)["model_id"]
    model = backend.models[model_id]
    assert backend.create_model(dict(explicit)) == rid  # the resend gets the first answer
    assert backend.models[model_id] is model  # and the model in use is the same object
    with pytest.raises(UserError, match="model_seq_id 7 is already taken"):
        backend.create_model({**explicit, "lora_config": {"rank": 8}})
    # a default id skips the ones taken explicitly
    later = result(backend, backend.create_model(dict(body)))["model_id"]
    assert later not in ids and later != model_id


def test_a_client_from_state_with_another_optimizer_is_refused_when_sent(backend):
    """load_weights ignored optimizer_config: the client was made, and only its first optim_step was refused."""
    model_id = new_model(backend)
    assert "error" not in result(backend, backend.save_weights({"model_id": model_id, "seq_id": 1, "path": "c"}))
    session = backend.models[model_id].session_id
    path = f"tinker://{model_id}/weights/c"
    before = len(backend.models)
    with pytest.raises(UserError, match="AdamW only"):
        backend.load_weights(
            {"session_id": session, "path": path, "optimizer": False, "optimizer_config": {"type": "dimuon"}}
        )
    assert len(backend.models) == before
    rid = backend.load_weights({"session_id": session, "path": path, "optimizer": False})
    assert result(backend, rid)["type"] == "load_weights"


def test_an_inflight_sampler_is_refused_not_served_as_a_snapshot(backend):
    model_id = new_model(backend)
    with pytest.raises(UserError, match="snapshot samplers only"):
        backend.save_weights_for_sampler({"model_id": model_id, "seq_id": 1, "kind": "inflight"})
    # the refused request used up its seq_id: the next one runs
    out = result(backend, backend.save_weights_for_sampler({"model_id": model_id, "seq_id": 2, "kind": "snapshot"}))
    assert "sampling_session_id" in out, out


# ---------------------------------------------------------------------- a forward_backward the SDK may split
@pytest.fixture(scope="module")
def small_body_server(tmp_path_factory):
    """A server in this process whose body limit (0.05 MiB) makes the SDK split a call of 25 datums of 89 tokens
    into chunks of 9, 9 and 7 (each datum is 1424 estimated bytes; a chunk holds at most 13107)."""
    import uvicorn

    from edurl.serve import create_app
    from edurl.serve.launch import free_port

    app = create_app(
        KEY,
        models=ModelRegistry(device="cpu", progress=False),
        state_dir=tmp_path_factory.mktemp("chunks"),
        max_body_bytes=int(0.05 * 2**20),
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": KEY}).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    yield service
    service.close("success").result()
    server.should_exit = True
    thread.join(timeout=30)


TOKENS = list(range(5, 95))
GOOD = types.Datum(
    model_input=types.ModelInput.from_ints(TOKENS[:-1]),
    loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
)
BAD = types.Datum(
    model_input=GOOD.model_input,
    loss_fn_inputs={"target_tokens": TOKENS[1:-1] + [10**6], "weights": [1.0] * (len(TOKENS) - 1)},
)
ADAM = types.AdamParams(learning_rate=1e-3)


def test_a_small_refused_call_keeps_the_gradients_before_it(small_body_server):
    """A call sent as one request runs none of its datums when refused, and leaves earlier calls' gradients be."""
    tc = small_body_server.create_lora_training_client(base_model=TINY_ARITHMETIC, rank=4).result()
    tc.forward_backward([GOOD] * 2, loss_fn="cross_entropy").result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match=r"datums\[1\]"):
        tc.forward_backward([GOOD, BAD], loss_fn="cross_entropy").result(timeout=60)
    tc.forward_backward([GOOD] * 2, loss_fn="cross_entropy").result(timeout=60)
    assert math.isfinite(tc.optim_step(ADAM).result(timeout=60).metrics["optim/grad_norm"])


# ---------------------------------------------------------------------- the command line
@pytest.mark.parametrize(
    "flags, match",
    [
        (["--max-body-mb", "-1"], "--max-body-mb"),
        (["--max-body-mb", "0"], "--max-body-mb"),
        (["--max-body-mb", "nan"], "--max-body-mb"),
        (["--max-body-mb", "inf"], "--max-body-mb"),
        (["--device", "bogus"], "--device bogus: .*unknown device"),
        (["--state-dir", "FILE"], "--state-dir .* is a file"),
    ],
)
def test_bad_flags_stop_the_server_before_it_loads_anything(tmp_path, monkeypatch, capsys, flags, match):
    """Each was accepted: -1 and 0 refused every request with 413, nan and inf ended in a traceback after the
    models had loaded, --device bogus failed inside the first create_model, and a --state-dir that is a file inside
    the first save_state."""
    from edurl.serve.__main__ import main
    from edurl.serve.launch import free_port

    def never(self, name):
        raise AssertionError(f"loaded {name} before refusing {flags}")

    monkeypatch.setattr(ModelRegistry, "load", never)
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder\n")
    flags = [str(a_file) if f == "FILE" else f for f in flags]
    with pytest.raises(SystemExit) as exit_:
        main(["--port", str(free_port()), "--api-key", KEY, "--preload", TINY_ARITHMETIC, *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "error: " in err and "serving" not in err, err
    import re

    assert re.search(match, err), err


def test_sigterm_removes_the_servers_own_state_folder(tmp_path):
    """uvicorn shuts down on SIGTERM and then raises the signal again, whose default action ends the process
    before any exit hook runs: every server stopped that way left its edurl-serve-* folder behind."""
    from edurl.serve.launch import free_port

    port = free_port()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "edurl.serve", "--port", str(port), "--api-key", KEY]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", headers={"X-API-Key": KEY}).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert len(list(tmp_path.glob("edurl-serve-*"))) == 1, proc.stderr.read().decode()[-2000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGTERM
    assert not list(tmp_path.glob("edurl-serve-*"))
