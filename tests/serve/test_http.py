"""edurl.serve's HTTP edges without the SDK: keys, body limits, malformed requests, unknown verbs, binding."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from edurl.serve.__main__ import is_loopback, resolve_key

from .conftest import KEY


def post(url: str, path: str, key: str | None = KEY, headers: dict | None = None, **kwargs) -> httpx.Response:
    headers = {**({"X-API-Key": key} if key is not None else {}), **(headers or {})}
    return httpx.post(f"{url}/api/v1/{path}", headers=headers, timeout=30, **kwargs)


def session(url: str) -> str:
    return post(url, "create_session", json={"tags": []}).json()["session_id"]


@pytest.mark.parametrize("key", [None, "tml-wrong", KEY + "x", ""])
def test_requests_without_the_key_get_401_and_create_nothing(server_url, key):
    r = post(server_url, "create_session", key=key, json={})
    assert r.status_code == 401
    assert "key" in r.json()["detail"]


def test_a_malformed_forward_backward_gets_400_with_the_reason_and_the_server_keeps_serving(server_url):
    r = post(
        server_url,
        "forward_backward",
        content=b"\xff\x00 not a protobuf",
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert r.status_code in (400, 404), r.text
    assert r.json()["detail"]
    assert post(server_url, "create_session", json={}).status_code == 200


def test_a_bad_json_body_and_a_missing_field_get_400(server_url):
    assert post(server_url, "create_model", content=b"{not json").status_code == 400
    r = post(server_url, "create_model", json={"base_model": "edurl/tiny-arithmetic"})
    assert r.status_code == 400 and "session_id" in r.json()["detail"]


def test_an_unknown_base_model_fails_the_future_with_the_reason(server_url):
    s = session(server_url)
    rid = post(
        server_url, "create_model", json={"session_id": s, "base_model": "/no/such/folder", "lora_config": {"rank": 8}}
    ).json()["request_id"]
    result = post(server_url, "retrieve_future", json={"request_id": rid}).json()
    assert result["category"] == "user" and "unknown base_model" in result["error"]


def test_an_unknown_verb_is_a_clear_404_not_a_hang(server_url):
    r = post(server_url, "no_such_verb", json={})
    assert r.status_code == 404 and "does not implement" in r.json()["detail"]


def test_a_body_over_the_limit_gets_413(server_url):
    r = post(server_url, "telemetry", content=b"x" * (65 * 2**20))
    assert r.status_code == 413


def test_a_finished_session_is_gone(server_url):
    s = session(server_url)
    assert post(server_url, "session_heartbeat", json={"session_id": s}).status_code == 200
    assert post(server_url, f"sessions/{s}/finish", json={"reason": {"type": "success"}}).status_code == 200
    assert post(server_url, "session_heartbeat", json={"session_id": s}).status_code == 410


def test_binding_beyond_loopback_needs_a_key_of_ones_own(monkeypatch):
    monkeypatch.delenv("EDURL_SERVE_API_KEY", raising=False)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.10")
    with pytest.raises(SystemExit, match="without an API key"):
        resolve_key("0.0.0.0", None)
    key, generated = resolve_key("127.0.0.1", None)
    assert generated and key.startswith("tml-")
    assert resolve_key("0.0.0.0", "tml-mine") == ("tml-mine", False)
    with pytest.raises(SystemExit, match="tml-"):
        resolve_key("127.0.0.1", "sk-wrong-prefix")
    monkeypatch.setenv("EDURL_SERVE_API_KEY", "tml-from-env")
    assert resolve_key("0.0.0.0", None) == ("tml-from-env", False)


def test_checkpoint_names_stay_one_folder_deep():
    from edurl.serve.app import _safe

    for hostile in ("..", ".", "../../etc", "a/b", "", "x:y"):
        safe = _safe(hostile)
        assert "/" not in safe and safe not in ("", ".", ".."), (hostile, safe)
    assert _safe("ckpt-1_a.b") == "ckpt-1_a.b"


def test_a_server_without_a_state_dir_removes_its_own_when_it_exits(tmp_path):
    # each server once left an edurl-serve-* folder, checkpoints and all, in the temp folder
    import subprocess
    import sys

    code = (
        "from edurl.serve.app import create_app\n"
        "app = create_app('tml-test')\n"
        "folder = app.state.backend.state_dir\n"
        "(folder / 'probe').write_text('x')\n"
        "print(folder)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    folder = out.stdout.strip().splitlines()[-1]
    assert "edurl-serve-" in folder and not Path(folder).exists()


def test_a_port_in_use_or_out_of_range_is_refused_before_serving(capsys):
    """The server printed "serving the Tinker API on ..." and then failed to bind; --port -1 was an OverflowError
    traceback."""
    import socket

    import pytest

    from edurl.serve.__main__ import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            main(["--port", str(port), "--api-key", "tml-local-key"])
    err = capsys.readouterr().err
    assert exit_.value.code == 3 and f"cannot listen on 127.0.0.1:{port}" in err and "serving" not in err
    for bad in ("-1", "70000", "http"):
        with pytest.raises(SystemExit) as exit_:
            main(["--port", bad, "--api-key", "tml-local-key"])
        assert exit_.value.code == 2 and "--port" in capsys.readouterr().err


@pytest.mark.parametrize(
    "os_name, exclusive, expected",
    [("posix", True, ["SO_REUSEADDR"]), ("nt", True, []), ("nt", False, [])],
)
def test_the_port_probe_binds_as_uvicorn_does(monkeypatch, os_name, exclusive, expected):
    """On Windows SO_REUSEADDR lets a socket bind a port another one listens on, so a probe that set it always
    passed there, and uvicorn (asyncio sets it only on posix) failed to bind after the models had loaded."""
    import types

    import edurl.serve.__main__ as serve_main

    options, bound = [], []

    class Probe:  # records what the probe sets, without binding anything
        def __init__(self, family, kind):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def setsockopt(self, level, option, value):
            options.append(option)

        def bind(self, address):
            bound.append(address)

    names = {"SO_REUSEADDR": "SO_REUSEADDR"} | ({"SO_EXCLUSIVEADDRUSE": "SO_EXCLUSIVEADDRUSE"} if exclusive else {})
    fake = types.SimpleNamespace(socket=Probe, AF_INET=2, AF_INET6=10, SOCK_STREAM=1, SOL_SOCKET=1, **names)
    monkeypatch.setattr(serve_main, "socket", fake)
    monkeypatch.setattr(serve_main, "os", types.SimpleNamespace(name=os_name))
    serve_main._check_free("127.0.0.1", 8000)
    assert options == expected and bound == [("127.0.0.1", 8000)]


def test_a_local_server_removes_the_state_folder_it_made_even_when_killed(tmp_path, monkeypatch):
    """The server removed its state folder in an exit hook, which does not run when LocalServer.stop() ends it with
    TerminateProcess (Popen.terminate on Windows): every run left an edurl-serve-* folder in the temp folder."""
    import tempfile

    from edurl.serve.launch import LocalServer

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the server's temp folder, should it make its own
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # and this process's
    server = LocalServer(device="cpu", preload=()).start()
    made = list(temp.glob("edurl-serve-*"))
    assert len(made) == 1 and made[0].is_dir()
    monkeypatch.setattr(server.proc, "terminate", server.proc.kill)  # as on Windows: no exit hooks run
    proc = server.proc
    server.stop()
    assert proc.poll() is not None and not list(temp.glob("edurl-serve-*"))

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "kept").write_text("x")
    with LocalServer(device="cpu", preload=(), state_dir=str(mine)) as server:
        assert server.proc.args[server.proc.args.index("--state-dir") + 1] == str(mine)
    assert (mine / "kept").exists() and not list(temp.glob("edurl-serve-*"))


def sampling_session(url: str) -> str:
    body = {"session_id": session(url), "base_model": "edurl/tiny-arithmetic"}
    return post(url, "create_sampling_session", json=body).json()["sampling_session_id"]


CHUNK = {"type": "encoded_text", "tokens": [1, 2, 3]}


@pytest.mark.parametrize(
    "verb, body, match",
    [
        ("create_model", {"lora_config": [1, 2]}, "lora_config must be a JSON object"),
        ("create_model", {"optimizer_config": "sgd"}, "optimizer_config must be a JSON object"),
        ("create_model", {"lora_config": {"rank": 0}}, r"lora_config.rank must be >= 1, got 0"),
        ("create_model", {"lora_config": {"rank": 4.5}}, "lora_config.rank must be an integer"),
        ("create_model", {"lora_config": {"rank": 4, "seed": "x"}}, "lora_config.seed must be an integer"),
        ("asample", {"prompt": [1, 2, 3]}, "prompt must be a JSON object"),
        ("asample", {"prompt": {"chunks": {"a": 1}}}, "prompt.chunks must be a list"),
        ("asample", {"prompt": {"chunks": [[1, 2, 3]]}}, r"prompt.chunks\[0\] must be an object"),
        ("asample", {"prompt": {"chunks": [{"tokens": [1.9, 2, 3]}]}}, r"tokens\[0\] must be an integer token id"),
        ("asample", {"sampling_params": [1]}, "sampling_params must be a JSON object"),
        ("asample", {"sampling_params": {"stop": 5}}, "stop must be a string, a list of strings or a list of token"),
        ("asample", {"sampling_params": {"seed": "x"}}, "sampling_params.seed must be an integer"),
        ("asample", {"sampling_params": {"seed": 1.5}}, "sampling_params.seed must be an integer"),
        ("asample", {"num_samples": "3"}, "num_samples must be an integer"),
        ("session_heartbeat", {"session_id": [1]}, "session_id must be a string"),
    ],
)
def test_nested_fields_of_the_wrong_type_get_400_with_the_field_and_the_server_keeps_serving(
    server_url, verb, body, match
):
    """Each was an AttributeError (HTTP 500), was read as something else (a float token id truncated, stop=5 no
    stop at all), or was accepted and failed later inside the queued work (a string seed, LoRA rank 0)."""
    if verb == "create_model":
        body = {"session_id": session(server_url), "base_model": "edurl/tiny-arithmetic", **body}
    elif verb == "asample":
        base = {"sampling_session_id": sampling_session(server_url), "prompt": {"chunks": [CHUNK]}, "num_samples": 1}
        body = {**base, "sampling_params": {"max_tokens": 4}, **body}
    r = post(server_url, verb, json=body)
    assert r.status_code == 400, r.text
    assert re.search(match, r.json()["detail"]), r.json()["detail"]
    good = {"sampling_session_id": sampling_session(server_url), "prompt": {"chunks": [CHUNK]}, "num_samples": 1}
    assert post(server_url, "asample", json={**good, "sampling_params": {"max_tokens": 4}}).status_code == 200


def test_a_seq_id_that_is_not_an_integer_gets_400(server_url):
    # int() read 2.5 as 2 and "0" as 0, and a missing seq_id was a KeyError (HTTP 500)
    rid = post(
        server_url,
        "create_model",
        json={"session_id": session(server_url), "base_model": "edurl/tiny-arithmetic", "lora_config": {"rank": 4}},
    ).json()["request_id"]
    model_id = post(server_url, "retrieve_future", json={"request_id": rid}).json()["model_id"]
    step = {"model_id": model_id, "adam_params": {"learning_rate": 1e-3}}
    for verb, extra in (("optim_step", step), ("save_weights", {"model_id": model_id, "path": "x"})):
        for bad in ({"seq_id": 2.5}, {"seq_id": "0"}, {"seq_id": True}, {}):
            r = post(server_url, verb, json={**extra, **bad})
            assert r.status_code == 400 and "seq_id must be an integer" in r.json()["detail"], (verb, bad, r.text)
    r = post(server_url, "load_weights", json={"session_id": session(server_url), "path": "x", "model_seq_id": 1.5})
    assert r.status_code == 400 and "model_seq_id must be an integer" in r.json()["detail"], r.text
