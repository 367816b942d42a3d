"""A local server for the part of the Tinker HTTP API that training and sampling loops use.

The official ``tinker`` SDK drives it unchanged: point ``tinker.ServiceClient(base_url=...)`` at it. Behind each
verb is edurl's own in-process client (:mod:`edurl.llm.clients`), so a loop run through HTTP computes what the
same loop computes in process.

How a request flows:

- Every request must carry the server's key in ``X-API-Key`` (compared in constant time); otherwise 401 and
  nothing happens. Bodies above ``max_body_bytes`` get 413.
- Verbs that do work (create_model, forward_backward, optim_step, save_*, load_weights, asample) return a
  ``request_id`` at once and queue the work. A training client's operations run in the order of their
  ``seq_id``; a repeated ``(model_id, seq_id)`` is the same operation, not a new one. The client config
  (``CLIENT_CONFIG``) has the SDK send a forward_backward as one request unless it nears the body limit, so that
  a refused batch runs none of its datums. All model work runs on one worker thread, in arrival order.
- ``retrieve_future`` long-polls: it waits up to ``poll_seconds`` for the result, then answers ``try_again``.
  A failed operation answers ``{"error": ..., "category": "user"}``, which the SDK raises as
  ``RequestFailedError``.
- A malformed request gets a 4xx with the reason, and the server keeps serving.

What it computes differently from the in-process client: ``forward_backward`` scores at temperature 1, since
Tinker's request has no temperature field, while the sampler reports log-probs at the sampling temperature (the
distribution it drew from). Training data sampled at T != 1 is therefore off-policy before any update (the ratio
``exp(train - sampling)`` is not 1, and ppo/cispo clip tokens they should not); sample it at temperature 1, as
``edurl.recipes.tinker_rl_loop`` requires. In process, ``TrainingClient.forward_backward(..., temperature=T)``
scores at the sampler's T.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import hmac
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from edurl.llm.clients import (
    LOSS_FN_NAMES,
    AdamParams,
    NoGradientError,
    SamplingClient,
    ServiceClient,
    TrainingClient,
)
from edurl.llm.sampling import SamplingParams, check_prompts, embedding_rows, sample
from edurl.serve import wire
from edurl.serve.models import ModelRegistry
from edurl.utils import file_in_the_way

PROTO = "application/x-protobuf"
API = "/api/v1"


class UserError(ValueError):
    """The request was understood but cannot be done (unknown model, bad loss config, ...): HTTP 400."""


class CheckpointWriteError(RuntimeError):
    """save_state could not write its file (a full disk, a name the file system refuses, ...): the save fails, but
    it changed no weight, so the model keeps working and can be saved again elsewhere."""


NAME_MAX_BYTES = 255  # the longest file or folder name most file systems take (ext4, APFS, NTFS: 255)


def _check_name_length(name: str, given: str) -> None:
    size = len(name.encode("utf-8"))
    if size > NAME_MAX_BYTES:
        raise UserError(
            f"checkpoint name {_shown(given)} is {size} bytes long; the file system takes names of at most "
            f"{NAME_MAX_BYTES} bytes (UTF-8): pick a shorter one"
        )


def _check_optimizer_config(body: dict) -> None:
    """edurl.serve builds AdamW for every model; a request for another optimizer is refused when it arrives."""
    optimizer = _object(body.get("optimizer_config"), "optimizer_config").get("type", "adamw")
    if optimizer != "adamw":
        raise UserError(f"optimizer_config type {optimizer!r}: edurl.serve implements AdamW only ('adamw')")


# The JSON verbs read nested fields by hand; each of these checks one field's type and names it when it is wrong
# (a list where an object belongs was an AttributeError, HTTP 500; a float token id was truncated; a seed that is
# a string failed later, inside the queued work)
def _shown(value) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _object(value, where: str) -> dict:
    """A JSON object field; null (or the field left out) reads as {}."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"{where} must be a JSON object ({{...}}), got {_shown(value)}")
    return value


def _integer(value, where: str, low: int | None = None, high: int | None = None) -> int:
    """A JSON integer: not a float (2.9 would be read as 2), a string or a boolean."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{where} must be an integer, got {_shown(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise UserError(f"{where} must be {bounds}, got {value}")
    return value


def _number(value, where: str) -> float:
    """A JSON number (an integer or a float, not a string or a boolean)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where} must be a number, got {_shown(value)}")
    return float(value)


def _id(value, where: str) -> str:
    if not isinstance(value, str):
        raise UserError(f"{where} must be a string id as the server returned it, got {_shown(value)}")
    return value


SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed takes (from 0)


@dataclass
class TrainingModel:
    model_id: str
    session_id: str
    base_model: str
    tokenizer_id: str
    client: TrainingClient
    lora_rank: int
    next_seq: int = 1
    pending: dict[int, tuple[concurrent.futures.Future, Any]] = field(default_factory=dict)
    submitted: dict[int, str] = field(default_factory=dict)  # seq_id -> request_id, to recognise a resend
    broken: str | None = None
    saving: set[str] = field(default_factory=set)  # checkpoint names whose save_state is queued, not yet written


@dataclass
class Sampler:
    sampler_id: str
    session_id: str
    base_model: str
    model_path: str | None
    client: SamplingClient


@dataclass
class Session:
    session_id: str
    last_seen: float
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    # model_seq_id -> (what was asked, request_id): a resent create_model gets the first one's answer, never a
    # second model over the first
    created: dict[int, tuple[tuple, str]] = field(default_factory=dict)
    next_model_seq: int = 0


class Backend:
    """Sessions, models, samplers and futures; the model work runs on one worker thread."""

    def __init__(
        self,
        models: ModelRegistry,
        state_dir: Path,
        poll_seconds: float = 25.0,
        max_futures: int = 10_000,
        session_timeout: float = 600.0,
        batch_window: float = 0.02,
        max_batch_wait: float = 0.25,
    ):
        self.models_registry = models
        self.state_dir = state_dir
        self.poll_seconds = poll_seconds
        self.max_futures = max_futures
        self.session_timeout = session_timeout  # a session silent this long (no heartbeat, no call) is dropped
        # a sampling batch waits while requests keep arriving (each within batch_window seconds of the one
        # before), for at most max_batch_wait seconds in all
        self.batch_window, self.max_batch_wait = batch_window, max_batch_wait
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self.sampler_weights: dict[str, tuple[str, SamplingClient]] = {}  # tinker:// path -> (base, snapshot)
        self.futures: dict[str, concurrent.futures.Future] = {}
        self.future_owner: dict[str, str] = {}
        self.lock = threading.RLock()
        self.worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="edurl-serve")
        self.counter = itertools.count()
        self.sample_queue: list[_SampleJob] = []
        self.sample_calls = 0  # batched sampler calls made so far (the tests read it)

    # ------------------------------------------------------------------ bookkeeping
    def session(self, session_id: str) -> Session:
        session = self.sessions.get(_id(session_id, "session_id"))
        if session is None:
            raise KeyError(f"unknown session_id {session_id!r}; create one with create_session")
        session.last_seen = time.time()
        return session

    def expire_idle_sessions(self) -> list[str]:
        """Drop sessions whose client stopped sending heartbeats (the SDK sends one every 10 s): a client that
        crashed without finishing its session does not keep its models in memory for ever."""
        cutoff = time.time() - self.session_timeout
        idle = [sid for sid, s in list(self.sessions.items()) if s.last_seen < cutoff]
        for sid in idle:
            self.finish_session(sid)
        return idle

    def new_session(self) -> str:
        self.expire_idle_sessions()
        session_id = f"edurl-{uuid.uuid4().hex[:12]}"
        with self.lock:
            self.sessions[session_id] = Session(session_id, time.time())
        return session_id

    def finish_session(self, session_id: str) -> None:
        """Drop the session's models, samplers and futures: their memory goes with them."""
        with self.lock:
            session = self.sessions.pop(session_id, None)
            if session is None:
                return
            for model_id in session.models:
                self.models.pop(model_id, None)
                for path in [p for p in self.sampler_weights if p.startswith(f"tinker://{model_id}/")]:
                    del self.sampler_weights[path]  # a copy of the adapter each (the base is shared); samplers keep it
            for sampler_id in session.samplers:
                self.samplers.pop(sampler_id, None)
            for rid in [r for r, owner in self.future_owner.items() if owner == session_id]:
                self.futures.pop(rid, None)
                self.future_owner.pop(rid, None)

    def _new_future(self, session_id: str) -> tuple[str, concurrent.futures.Future]:
        rid = f"req-{next(self.counter)}-{uuid.uuid4().hex[:8]}"
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.futures[rid] = fut
            self.future_owner[rid] = session_id
            while len(self.futures) > self.max_futures:  # oldest first; dicts keep insertion order
                old = next(iter(self.futures))
                self.futures.pop(old)
                self.future_owner.pop(old, None)
        return rid, fut

    def _execute(self, fut: concurrent.futures.Future, fn) -> None:
        def job():
            try:
                fut.set_result(fn())
            except (ValueError, TypeError, KeyError, RuntimeError) as exc:  # UserError, WireError among them
                fut.set_result({"error": str(exc), "category": "user"})
            except Exception as exc:  # noqa: BLE001 - reported to the client, never kills the worker
                fut.set_result({"error": f"{type(exc).__name__}: {exc}", "category": "server"})

        self.worker.submit(job)

    def submit(self, session_id: str, fn) -> str:
        """Queue `fn` on the worker; its return value (a JSON dict or protobuf bytes) is the future's result."""
        rid, fut = self._new_future(session_id)
        self._execute(fut, fn)
        return rid

    def submit_ordered(self, model: TrainingModel, seq_id: int, fn) -> str:
        """Queue a training operation to run in seq_id order; a resent seq_id returns the first request's id."""
        with self.lock:
            if seq_id in model.submitted:
                return model.submitted[seq_id]
            if seq_id < model.next_seq:
                raise UserError(f"seq_id {seq_id} of {model.model_id} already ran (next is {model.next_seq})")
            rid, fut = self._new_future(model.session_id)
            model.submitted[seq_id] = rid
            model.pending[seq_id] = (fut, fn)
            while model.next_seq in model.pending:
                ready_fut, ready_fn = model.pending.pop(model.next_seq)
                self._execute(ready_fut, self._guard(model, ready_fn))
                model.submitted.pop(model.next_seq - 1024, None)  # resends come soon after; old ids can go
                model.next_seq += 1
        return rid

    def validate_ordered(self, model: TrainingModel, seq_id: int, prepare):
        """``prepare()``, the submit-time checks of an ordered operation. If they fail, the request gets its 400,
        and its seq_id is still used up by an operation that does nothing: the SDK counted it, and the
        client's next operation carries the next seq_id, which would otherwise wait for this one for ever."""
        try:
            return prepare()
        except Exception:
            self.submit_ordered(model, seq_id, lambda: {"type": "refused_at_submit"})
            raise

    @staticmethod
    def _guard(model: TrainingModel, fn):
        """After a failed operation, the model's later operations fail too (the SDK does the same), except after
        a refused input or step (ValueError, TypeError, an optim_step with no gradients, or one whose gradient norm
        is not finite): the training client raises those before it changes any weight, so one bad request does
        not take the model with it."""

        def run():
            if model.broken:
                raise UserError(f"an earlier operation on {model.model_id} failed: {model.broken}")
            try:
                return fn()
            # refused before any weight moved, or a save that could not write (it moves none)
            except (ValueError, TypeError, NoGradientError, FloatingPointError, CheckpointWriteError):
                raise
            except Exception as exc:
                model.broken = str(exc)
                raise

        return run

    async def result(self, request_id: str):
        fut = self.futures.get(request_id)
        if fut is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), timeout=self.poll_seconds)
        except asyncio.TimeoutError:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}

    # ------------------------------------------------------------------ training
    def create_model(self, body: dict) -> str:
        session = self.session(body["session_id"])
        base_model = body.get("base_model")
        if not isinstance(base_model, str) or not base_model:
            raise UserError("create_model needs a base_model: 'edurl/tiny-arithmetic' or a local Hugging Face folder")
        lora = _object(body.get("lora_config"), "lora_config")
        rank = _integer(lora.get("rank", 32), "lora_config.rank", low=1)  # peft refused 0 only inside the work
        _check_optimizer_config(body)
        if lora.get("train_attn", True) is False or lora.get("train_mlp", True) is False:
            raise UserError(
                "lora_config with train_attn=False or train_mlp=False: edurl.serve adapts the attention and MLP "
                "layers together (and never the unembedding); send both True"
            )
        seed = lora.get("seed", body.get("seed"))  # the SDK sends it inside lora_config
        if seed is not None:
            _integer(seed, "lora_config.seed" if "seed" in lora else "seed", *SEED_RANGE)
        asked = ("create_model", base_model, rank, seed)

        def make(model_id: str):
            def run():
                self._add_model(session, model_id, base_model, rank, seed)
                return {"model_id": model_id, "type": "create_model"}

            return run

        return self._submit_new_model(session, body.get("model_seq_id"), asked, make)

    def _submit_new_model(self, session: Session, model_seq_id, asked: tuple, make) -> str:
        """Queue ``make(model_id)()``, the work that builds a new model in ``session``, and return its request id.

        Without a ``model_seq_id`` the model takes the session's next free one, counted here, under the lock, when
        the request arrives (two requests sent back to back once both read the same count and got one id, and
        the second model replaced the first). A ``model_seq_id`` already used is the same request sent again: it
        gets the first request's id, and the model in use is never rebuilt; asking for something else under it
        is refused."""
        if model_seq_id is not None:
            model_seq_id = _integer(model_seq_id, "model_seq_id", low=0)
        with self.lock:
            if model_seq_id is None:
                while session.next_model_seq in session.created:
                    session.next_model_seq += 1
                model_seq_id = session.next_model_seq
            elif model_seq_id in session.created:
                first, rid = session.created[model_seq_id]
                if first == asked:
                    return rid
                raise UserError(
                    f"model_seq_id {model_seq_id} is already taken in session {session.session_id} (by {first[0]} "
                    f"of {_shown(first[1])}); give each new model a model_seq_id of its own, or leave it out"
                )
            rid = self.submit(session.session_id, make(f"{session.session_id}:train:{model_seq_id}"))
            session.created[model_seq_id] = (asked, rid)
        return rid

    def _add_model(self, session: Session, model_id: str, base_model: str, rank: int, seed=None) -> TrainingModel:
        """A LoRA training client on ``base_model`` (seeded, if asked), registered in ``session``. Its
        checkpoints go under the server's state folder, in a folder of its own."""
        model, tokenizer, tokenizer_id = self.models_registry.load(base_model)
        if seed is not None:
            torch.manual_seed(int(seed))
        service = ServiceClient(device=self.models_registry.device, log_dir=self.state_dir / _safe(model_id))
        client = service.create_lora_training_client((model, tokenizer), rank=rank)
        m = TrainingModel(model_id, session.session_id, base_model, tokenizer_id, client, rank)
        with self.lock:
            self.models[model_id] = m
            session.models.append(model_id)
        return m

    def model(self, model_id: str) -> TrainingModel:
        model = self.models.get(_id(model_id, "model_id"))
        if model is None:
            raise KeyError(f"unknown model_id {model_id!r}; create it with create_model first")
        self.session(model.session_id)
        return model

    def info(self, model_id: str) -> dict:
        m = self.model(model_id)
        data = {"arch": type(m.client.model).__name__, "model_name": m.base_model, "tokenizer_id": m.tokenizer_id}
        return {
            "model_id": model_id,
            "model_data": data,
            "is_lora": True,
            "lora_rank": m.lora_rank,
            "model_name": m.base_model,
            "type": "get_info",
        }

    def forward_backward(self, raw: bytes) -> str:
        request = wire.pb.ForwardBackwardRequest()
        try:
            request.ParseFromString(raw)
        except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError
            raise wire.WireError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from None
        m = self.model(request.model_id)
        loss_fn = request.loss_fn

        def prepare():  # malformed data fails here, at submit time (HTTP 400)
            if loss_fn not in LOSS_FN_NAMES:
                raise UserError(f"unknown loss_fn {loss_fn!r}; edurl.serve implements {list(LOSS_FN_NAMES)}")
            rl = loss_fn != "cross_entropy"
            datums, config = wire.datums_from_request(request, rl), wire.loss_fn_config(request) or None
            m.client.check_inputs(datums, loss_fn, config)  # fields, target tokens, config keys: a 400, not a failure
            return datums, config

        datums, config = self.validate_ordered(m, int(request.seq_id), prepare)
        forward_only = request.forward_only

        def run():
            call = m.client.forward if forward_only else m.client.forward_backward
            out = call(datums, loss_fn, config).result()
            return wire.forward_backward_output([o["logprobs"] for o in out.loss_fn_outputs], out.loss, out.metrics)

        return self.submit_ordered(m, int(request.seq_id), run)

    def optim_step(self, body: dict) -> str:
        m = self.model(body["model_id"])
        allowed = {"learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"}
        other = body.get("optimizer_params")

        def prepare():
            if other is not None:
                kind = other.get("type", "?") if isinstance(other, dict) else type(other).__name__
                raise UserError(
                    f"optim_step with optimizer params of type {kind!r}: edurl.serve implements Adam only; send "
                    "AdamParams (it once ran AdamW with its own defaults instead)"
                )
            if "adam_params" not in body:
                raise UserError(
                    "optim_step needs adam_params (types.AdamParams(...)); edurl.serve implements Adam only"
                )
            given = _object(body["adam_params"], "adam_params")
            unknown = set(given) - allowed
            if unknown:
                raise UserError(f"adam_params has unknown fields {sorted(unknown)}; known: {sorted(allowed)}")
            # Tinker's defaults come with the request; AdamParams refuses values out of range (a 400)
            return AdamParams(
                **{
                    k: None if k == "grad_clip_norm" and v is None else _number(v, f"adam_params.{k}")
                    for k, v in given.items()
                }
            )

        seq_id = _integer(body.get("seq_id"), "seq_id")
        params = self.validate_ordered(m, seq_id, prepare)

        def run():
            metrics = m.client.optim_step(params).result()
            return {"metrics": metrics, "type": "optim_step"}

        return self.submit_ordered(m, seq_id, run)

    def save_weights(self, body: dict) -> str:
        """``save_state``: TrainingClient.save_state, with what a new client made from it needs in ``extra``."""
        m = self.model(body["model_id"])
        given = str(body.get("path") or f"step-{body.get('seq_id')}")
        name = _safe(given)
        path = f"tinker://{m.model_id}/weights/{name}"
        seq_id = _integer(body.get("seq_id"), "seq_id")

        def prepare():
            if name != given:  # 'run/1', 'run_1' and 'run:1' would all be 'run_1'
                raise UserError(f"checkpoint name {_shown(given)}: use letters, digits, '-', '_' and '.' only")
            # a longer one passed these checks, and the write failed in the worker (ENAMETOOLONG)
            _check_name_length(name, given)
            if resend:  # a resend of this very save: submit_ordered answers it
                return
            # a save of the same name still queued counts as existing (both would get one path)
            if ((m.client._state_path(name) / "state.pt").exists() or name in m.saving) and not body.get("overwrite"):
                raise UserError(
                    f"a checkpoint named {given!r} exists on this model; pick another name or overwrite=True"
                )
            m.saving.add(name)

        def run():
            try:
                m.client.save_state(name, extra={"base_model": m.base_model, "lora_rank": m.lora_rank})
            except OSError as exc:  # a save moves no weight: the model keeps working (it was once marked broken)
                folder = m.client._state_path(name)
                # the in-process client's own message advises its log_dir, which an HTTP client cannot set
                cause = exc.strerror or file_in_the_way(folder) or str(exc)
                raise CheckpointWriteError(
                    f"save_state could not write {path} to {folder} on the server: {cause}. No weight changed, and "
                    "the model still works: make room there, or restart the server with another --state-dir, and "
                    "save again"
                ) from None
            finally:
                with self.lock:
                    m.saving.discard(name)
            return {"path": path, "type": "save_weights"}

        with self.lock:  # the name's check and the save's registration as one step: a resend sees one or the other
            resend = seq_id in m.submitted
            self.validate_ordered(m, seq_id, prepare)
            try:
                return self.submit_ordered(m, seq_id, run)
            except Exception:
                if not resend:
                    m.saving.discard(name)  # never queued: the name is free again
                raise

    def _checkpoint_dir(self, path: str) -> Path:
        """The folder that ``save_state`` wrote for a ``tinker://<model>/weights/<name>`` path."""
        prefix = "tinker://"
        if not path.startswith(prefix) or "/weights/" not in path:
            raise UserError(f"{path!r} is not a checkpoint path from save_state (tinker://<model>/weights/<name>)")
        model_id, name = path[len(prefix) :].split("/weights/", 1)
        folder = self.state_dir / _safe(model_id) / "checkpoints" / _safe(name)
        try:  # a name too long for the file system raised OSError here: HTTP 500, which the SDK retried for ever
            found = (folder / "state.pt").exists()
        except OSError as exc:
            raise UserError(f"no checkpoint at {_shown(path)} on this server ({exc.strerror or exc})") from None
        if not found:
            raise UserError(f"no checkpoint at {_shown(path)} on this server")
        return folder

    def load_weights(self, body: dict) -> str:
        path = str(body.get("path", ""))
        with_optimizer = bool(body.get("optimizer", False))
        if "model_id" in body:
            m = self.model(body["model_id"])
            seq_id = _integer(body.get("seq_id"), "seq_id")

            def prepare():
                _check_optimizer_config(body)
                self._checkpoint_dir(path)

            self.validate_ordered(m, seq_id, prepare)
            return self.submit_ordered(m, seq_id, lambda: self._load_into(m, path, with_optimizer))
        # create_training_client_from_state: a new model in the session, made from the checkpoint. What
        # create_model refuses is refused here too, when the request arrives (an optimizer other than AdamW was
        # accepted, and only the first optim_step said no)
        session = self.session(body["session_id"])
        if body.get("model_seq_id") is not None:  # named before the path (_submit_new_model checks it again)
            _integer(body["model_seq_id"], "model_seq_id", low=0)
        _check_optimizer_config(body)
        base_model = body.get("base_model")
        self._checkpoint_dir(path)
        asked = ("load_weights", path, with_optimizer, base_model)

        def make(model_id: str):
            def run():
                state = torch.load(self._checkpoint_dir(path) / "state.pt", map_location="cpu", weights_only=False)
                base = base_model or state["extra"]["base_model"]
                m = self._add_model(session, model_id, base, int(state["extra"]["lora_rank"]))
                return self._load_into(m, path, with_optimizer)

            return run

        return self._submit_new_model(session, body.get("model_seq_id"), asked, make)

    def _load_into(self, m: TrainingModel, path: str, with_optimizer: bool) -> dict:
        folder = self._checkpoint_dir(path)
        try:  # weights only (Tinker's load_state) starts a fresh optimizer, as the client's load_state does
            m.client.load_state(folder, optimizer=with_optimizer)
        except ValueError as exc:  # saved from another model
            raise UserError(f"checkpoint {path!r} does not fit {m.model_id}: {exc}") from None
        return {"path": path, "model_id": m.model_id, "type": "load_weights"}

    # ------------------------------------------------------------------ sampling
    def _register_sampler(self, session: Session, base_model: str, model_path: str | None, client) -> str:
        sampler_id = f"{session.session_id}:sample:{len(session.samplers)}-{uuid.uuid4().hex[:6]}"
        with self.lock:
            self.samplers[sampler_id] = Sampler(sampler_id, session.session_id, base_model, model_path, client)
            session.samplers.append(sampler_id)
        return sampler_id

    def save_weights_for_sampler(self, body: dict) -> str:
        m = self.model(body["model_id"])
        session = self.session(m.session_id)
        name = body.get("path")
        seq_id = _integer(body.get("seq_id"), "seq_id")

        def prepare():
            kind = body.get("kind", "snapshot")
            if kind not in (None, "snapshot"):  # an inflight sampler was served as a snapshot, without a word
                raise UserError(
                    f"sampler kind {_shown(kind)}: edurl.serve implements snapshot samplers only (fixed weights, "
                    "saved when asked); send kind='snapshot' (the default), and save again after each step"
                )

        self.validate_ordered(m, seq_id, prepare)

        def run():
            snapshot = m.client.save_weights_and_get_sampling_client()
            if name:
                path = f"tinker://{m.model_id}/sampler_weights/{name}"
                with self.lock:
                    self.sampler_weights[path] = (m.base_model, snapshot)
                return {"path": path, "type": "save_weights_for_sampler"}
            sampler_id = self._register_sampler(session, m.base_model, None, snapshot)
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        return self.submit_ordered(m, seq_id, run)

    def create_sampling_session(self, body: dict) -> dict:
        session = self.session(body["session_id"])
        model_path, base_model = body.get("model_path"), body.get("base_model")
        if model_path:
            with self.lock:
                entry = self.sampler_weights.get(model_path)
            if entry is None:
                raise UserError(
                    f"no sampler weights at {model_path!r}; save them with save_weights_for_sampler(name) (named "
                    "weights last as long as the session that saved them)"
                )
            base, client = entry
        elif base_model:
            model, tokenizer, _ = self.models_registry.load(base_model)
            base, client = base_model, SamplingClient(model, tokenizer, name=base_model)
        else:
            raise UserError("create_sampling_session needs model_path or base_model")
        sampler_id = self._register_sampler(session, base, model_path, client)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    def sampler(self, sampler_id: str) -> Sampler:
        s = self.samplers.get(_id(sampler_id, "sampling_session_id"))
        if s is None:
            raise KeyError(f"unknown sampling_session_id {sampler_id!r}")
        self.session(s.session_id)
        return s

    def asample(self, body: dict) -> dict:
        s = self.sampler(body["sampling_session_id"])
        chunks = _object(body.get("prompt"), "prompt").get("chunks") or []
        if not isinstance(chunks, list):
            raise UserError(
                f'prompt.chunks must be a list of chunks like {{"type": "encoded_text", "tokens": [...]}}, got '
                f"{_shown(chunks)}"
            )
        tokens: list[int] = []
        for k, chunk in enumerate(chunks):
            if not isinstance(chunk, dict):
                raise UserError(
                    f'prompt.chunks[{k}] must be an object like {{"type": "encoded_text", "tokens": [...]}}, got '
                    f"{_shown(chunk)}"
                )
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise UserError(f"prompt chunk {k} is {chunk.get('type')!r}; edurl.serve reads encoded_text only")
            ids = chunk.get("tokens", [])
            if not isinstance(ids, list):
                raise UserError(f"prompt.chunks[{k}].tokens must be a list of token ids, got {_shown(ids)}")
            for j, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise UserError(f"prompt.chunks[{k}].tokens[{j}] must be an integer token id, got {_shown(t)}")
            tokens += ids
        if not tokens:
            raise UserError("the prompt has no tokens")
        unsupported = [
            key
            for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")
            if body.get(key)  # 0 or None: not asked for
        ] + [key for key in ("target_prompt_logprobs", "prompt_logprobs_last_n") if body.get(key) is not None]
        if unsupported:
            raise UserError(
                f"edurl.serve does not implement {unsupported} (it would return without them); leave them unset"
            )
        n = _integer(body.get("num_samples", 1), "num_samples", 1, 1024)
        sp = _object(body.get("sampling_params"), "sampling_params")
        tokenizer = s.client.tokenizer
        stop = sp.get("stop", None)
        stops: list[list[int]] = []
        eos: list[int] | None = None  # None: the model's own end-of-sequence ids
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not isinstance(stop, list):  # a bare 5 was once ignored: no stop at all
            raise UserError(
                f"sampling_params.stop must be a string, a list of strings or a list of token ids, got {_shown(stop)}"
            )
        if isinstance(stop, list):
            if not stop:
                eos = []  # Tinker: an empty list never stops before max_tokens
            for k, item in enumerate(stop):
                if isinstance(item, str):
                    stops.append(tokenizer.encode(item, add_special_tokens=False))
                else:
                    stops.append([_integer(item, f"sampling_params.stop[{k}] (a string or a token id)", low=0)])
        top_k = _integer(sp.get("top_k", -1), "sampling_params.top_k")
        if top_k not in (-1, 0):
            raise UserError("top_k is not supported by edurl's sampler; send top_k=-1")
        max_tokens = sp.get("max_tokens")
        seed = sp.get("seed")
        params = SamplingParams(
            # 0 is refused, not read as "unset"
            max_tokens=32 if max_tokens is None else _integer(max_tokens, "sampling_params.max_tokens"),
            temperature=_number(sp.get("temperature", 1.0), "sampling_params.temperature"),
            top_p=_number(sp.get("top_p", 1.0), "sampling_params.top_p"),
            stop=stops,
            seed=None if seed is None else _integer(seed, "sampling_params.seed", *SEED_RANGE),
        )
        # what would fail inside a batched call fails here, for this request alone (a 400): an empty stop string
        # (it encodes to no tokens), a prompt id outside the model's vocabulary
        params.stop_sequences()
        check_prompts([tokens], embedding_rows(s.client.model))
        job = _SampleJob(
            model=s.client.model,
            pad=tokenizer.pad_token_id,
            tokens=tokens,
            n=n,
            params=params,
            eos=eos,
            prompt_logprobs=bool(body.get("prompt_logprobs", False)),
        )
        rid, job.future = self._new_future(s.session_id)
        with self.lock:
            self.sample_queue.append(job)
        self.worker.submit(self._drain_samples)
        return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]}

    def _drain_samples(self) -> None:
        """Run every sampling request queued so far, batching those that can share one call.

        The SDK sends one request per prompt; a GRPO step sends a batch of them at once. Requests for the same
        model with the same settings become one batched ``sample`` call, as the in-process loop's
        ``sample_batch`` makes them. A request with a seed runs alone, so that its draws depend on its seed only.
        """
        if not self.sample_queue:  # an earlier drain served this request already
            return
        # The SDK sends a step's requests one after another, and they reach the server a few milliseconds apart
        # (32 over 60-100 ms on 2 cores), so the first can arrive well before the last: wait until none has come
        # for one window (a fixed 5 ms wait split a step's requests into two or three batched calls, each about
        # as slow as one, since a call's time goes on its token steps)
        waited, seen = 0.0, -1
        while self.batch_window > 0 and waited < self.max_batch_wait:
            with self.lock:
                queued = len(self.sample_queue)
            if queued == seen:
                break
            seen = queued
            time.sleep(self.batch_window)
            waited += self.batch_window
        with self.lock:
            jobs, self.sample_queue = self.sample_queue, []
        groups: dict[tuple, list[_SampleJob]] = {}
        for job in jobs:
            try:
                groups.setdefault(job.batch_key(), []).append(job)
            except Exception as exc:  # noqa: BLE001 - this job's answer; the drain goes on for the others
                job.future.set_result({"error": f"{type(exc).__name__}: {exc}", "category": "user"})
        for group in groups.values():
            first = group[0]
            try:
                out = sample(
                    first.model,
                    [j.tokens for j in group],
                    first.n,
                    first.params,
                    pad_token_id=first.pad,
                    eos_token_id=first.eos,
                )
                self.sample_calls += 1
                for i, job in enumerate(group):
                    prompt_lp = prompt_logprobs(job.model, job.tokens) if job.prompt_logprobs else None
                    job.future.set_result(wire.sample_response(out[i * job.n : (i + 1) * job.n], prompt_lp))
            except Exception as exc:  # noqa: BLE001 - reported to each client, never kills the worker
                for job in group:
                    if not job.future.done():
                        job.future.set_result({"error": f"{type(exc).__name__}: {exc}", "category": "user"})


@dataclass
class _SampleJob:
    model: Any
    pad: int | None
    tokens: list[int]
    n: int
    params: SamplingParams
    eos: list[int] | None
    prompt_logprobs: bool
    future: concurrent.futures.Future | None = None

    def batch_key(self) -> tuple:
        p = self.params
        if p.seed is not None:
            return (id(self),)
        stops = tuple(tuple(x) for x in p.stop_sequences())
        eos = None if self.eos is None else tuple(self.eos)
        return (id(self.model), self.n, p.max_tokens, p.temperature, p.top_p, stops, eos)


def _safe(name: str) -> str:
    """``name`` as one folder name: letters, digits, '-', '_' and '.', and never '.' or '..'."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return safe if safe.strip(".") else safe.replace(".", "_") or "_"


def prompt_logprobs(model, tokens: list[int]) -> list[float]:
    """log p(token_t | tokens_<t) for every prompt position; NaN at position 0, which has no context."""
    device = next(model.parameters()).device
    with torch.no_grad():
        ids = torch.tensor([tokens], device=device)
        logits = model(input_ids=ids).logits.float()
        lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return [float("nan")] + lp.cpu().tolist()


def _rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where that is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# ---------------------------------------------------------------------- the HTTP app
def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


class _Limits:
    """ASGI middleware: the API key (401 before anything else happens) and the body size (413)."""

    def __init__(self, app, api_key: str, max_body_bytes: int):
        self.app, self.api_key, self.max_body = app, api_key.encode(), max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        key = headers.get(b"x-api-key", b"")
        if not hmac.compare_digest(key, self.api_key):
            reason = "missing X-API-Key header" if not key else "wrong API key"
            return await _error(401, f"{reason}: pass the key the server was started with").__call__(
                scope, receive, send
            )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await _error(413, f"request body of {int(length)} bytes is over the limit of {self.max_body}")(
                scope, receive, send
            )
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await _error(413, f"request body is over the limit of {self.max_body} bytes")(scope, receive, send)


class _TooLarge(Exception):
    pass


CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    # The SDK splits a forward_backward into chunks of at most fwdbwd_max_chunk_len datums (Tinker's 1024) and
    # fwdbwd_max_chunk_bytes_count estimated bytes, each a request with a seq_id of its own, checked on its own. A
    # refused chunk left the other chunks' gradients in place, and when it was not the first, the SDK never sent
    # the first, so the server waited for that seq_id for ever. Here a call is one request (so one 400 refuses the
    # whole batch and nothing runs) unless it nears the body limit (client_config below sets the bytes), and the
    # chunks of a call that large go one after another, the first first, so a refused one leaves no gap
    "parallel_fwdbwd_chunks": False,
    "fwdbwd_max_chunk_len": 2**31 - 1,
}


def create_app(
    api_key: str,
    models: ModelRegistry | None = None,
    state_dir: str | Path | None = None,
    max_body_bytes: int = 64 * 2**20,
    poll_seconds: float = 25.0,
) -> FastAPI:
    """The FastAPI app. ``api_key`` must start with ``tml-`` (the SDK refuses other keys)."""
    if not api_key.startswith("tml-"):
        raise ValueError("the API key must start with 'tml-', as the tinker SDK requires of every key")
    # A folder of its own, removed when the process exits (every server once left one). A killed server (on
    # Windows, Popen.terminate) runs no exit hooks, so LocalServer makes the folder, passes it, and removes it.
    if state_dir is None:
        state_dir = tempfile.mkdtemp(prefix="edurl-serve-")
        atexit.register(shutil.rmtree, state_dir, True)
    backend = Backend(models or ModelRegistry(), Path(state_dir), poll_seconds=poll_seconds)
    app = FastAPI(title="edurl.serve: a local Tinker-compatible server", docs_url=None, redoc_url=None)
    app.state.backend = backend
    app.add_middleware(_Limits, api_key=api_key, max_body_bytes=max_body_bytes)

    async def body_json(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise wire.WireError("the body is not JSON") from None
        if not isinstance(body, dict):
            raise wire.WireError("the body must be a JSON object")
        return body

    @app.exception_handler(ValueError)  # WireError and UserError too: a request that cannot be served as sent
    @app.exception_handler(TypeError)
    async def bad_request(request: Request, exc: Exception):
        return _error(400, str(exc))

    @app.exception_handler(KeyError)
    async def not_found(request: Request, exc: KeyError):
        message = exc.args[0] if exc.args else str(exc)
        if isinstance(message, str) and not message.startswith("unknown"):
            return _error(400, f"the request lacks the field {message!r}")
        return _error(404, str(message))

    @app.exception_handler(404)
    async def unknown_route(request: Request, exc):
        return _error(
            404,
            f"edurl.serve does not implement {request.method} {request.url.path}. It serves the Tinker API's "
            "training and sampling verbs under /api/v1 (see edurl/serve/app.py).",
        )

    @app.post(f"{API}/client/config")
    async def client_config(request: Request):
        # the SDK's estimate counts tensor bytes only; a request's protobuf framing adds to it (a lot, for datums of
        # a few tokens), so a chunk is kept to a quarter of the body limit
        return {**CLIENT_CONFIG, "fwdbwd_max_chunk_bytes_count": max_body_bytes // 4}

    @app.post(f"{API}/client/dynamic_config")
    async def dynamic_config(request: Request):
        return {}

    @app.get(f"{API}/edurl/stats")
    async def stats():
        """What the server holds now (not part of Tinker's API): the load test reads it for leaks."""
        return {
            "sessions": len(backend.sessions),
            "models": len(backend.models),
            "samplers": len(backend.samplers),
            "futures": len(backend.futures),
            "sample_calls": backend.sample_calls,
            "rss_bytes": _rss_bytes(),
        }

    @app.get(f"{API}/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities():
        return {
            "supported_models": [
                {"model_name": name, "trainable": True, "sampleable": True} for name in backend.models_registry.names()
            ]
        }

    @app.post(f"{API}/create_session")
    async def create_session(request: Request):
        await body_json(request)
        return {"session_id": backend.new_session(), "type": "create_session"}

    @app.post(f"{API}/session_heartbeat")
    async def heartbeat(request: Request):
        body = await body_json(request)
        if _id(body.get("session_id"), "session_id") not in backend.sessions:
            return _error(410, "unknown or finished session")
        backend.session(body["session_id"])
        return {"type": "session_heartbeat"}

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish(session_id: str):
        backend.finish_session(session_id)
        return {}

    @app.post(f"{API}/telemetry")
    async def telemetry(request: Request):
        await request.body()  # accepted and dropped
        return {"status": "accepted"}

    def future_verb(name: str):
        """A verb that queues work: its JSON body goes to the backend method of the same name."""
        method = getattr(backend, name)

        async def route(request: Request):
            return {"request_id": method(await body_json(request))}

        app.post(f"{API}/{name}", name=name)(route)

    for verb in ("create_model", "optim_step", "save_weights", "load_weights", "save_weights_for_sampler"):
        future_verb(verb)

    @app.post(f"{API}/get_info")
    async def get_info(request: Request):
        return backend.info((await body_json(request))["model_id"])

    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request):
        return {"request_id": backend.forward_backward(await request.body())}

    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request):
        # may load a base model: off the event loop, so heartbeats and other clients keep being answered
        return await asyncio.to_thread(backend.create_sampling_session, await body_json(request))

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str):
        s = backend.sampler(sampler_id)
        return {"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    @app.post(f"{API}/asample")
    async def asample(request: Request):
        return backend.asample(await body_json(request))

    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request):
        body = await body_json(request)
        result = await backend.result(str(body.get("request_id")))
        if result is None:
            return _error(404, f"unknown request_id {body.get('request_id')!r}")
        if isinstance(result, bytes):
            return Response(result, media_type=PROTO)
        return result

    return app
