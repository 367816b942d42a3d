"""The Tinker HTTP API's data on the wire, translated to and from edurl's types.

Most of the API speaks JSON. Two messages are protobuf: the body of ``POST /api/v1/forward_backward`` and the
results of forward/backward and sampling futures. Their schema (``tinker_public``, proto3) ships inside the
official ``tinker`` SDK; this module reads it from there, so the server and the SDK always agree on it.

Token ids travel as little-endian int32 bytes, float tensors as little-endian float32, int64 tensors as
little-endian int64. A per-datum output tensor is sent for all datums at once: the values concatenated, plus
int64 *byte* offsets where each datum starts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from edurl.llm.datum import Datum, ModelInput

try:
    from tinker.proto import tinker_public_pb2 as pb
except ImportError as exc:  # pragma: no cover - exercised by the CLI's message
    raise ImportError(
        "edurl.serve needs the official tinker SDK for its wire schema (Python >= 3.11): pip install -e '.[tinker]'"
    ) from exc


class WireError(ValueError):
    """A request the server cannot read; answered with HTTP 400 and this message."""


_DTYPES = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_INT64: np.dtype("<i8"), pb.DTYPE_INT32: np.dtype("<i4")}


def tokens_from_chunks(chunks, where: str) -> list[int]:
    """The token ids of a ModelInput's chunks, in order (only encoded text: the course has no images)."""
    tokens: list[int] = []
    for k, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"{where}: chunk {k} is {kind!r}; edurl.serve models read encoded_text chunks only")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(f"{where}: chunk {k} has {len(raw)} token bytes, not a multiple of 4 (int32)")
        tokens += np.frombuffer(raw, dtype="<i4").astype(np.int64).tolist()
    return tokens


def tensor_to_torch(t, where: str) -> torch.Tensor:
    if t.WhichOneof("encoding") != "dense":
        raise WireError(f"{where}: only dense tensors are supported (got {t.WhichOneof('encoding')!r})")
    if t.dtype not in _DTYPES:
        raise WireError(f"{where}: unsupported dtype {pb.DType.Name(t.dtype)}; send float32 or int64")
    dtype = _DTYPES[t.dtype]
    if len(t.dense) % dtype.itemsize:
        raise WireError(f"{where}: {len(t.dense)} bytes is not a whole number of {dtype.name} values")
    values = np.frombuffer(t.dense, dtype=dtype)
    shape = tuple(t.shape) or (values.size,)
    if int(np.prod(shape)) != values.size:
        raise WireError(f"{where}: shape {list(shape)} needs {int(np.prod(shape))} values, got {values.size}")
    out = torch.from_numpy(values.reshape(shape).copy())
    return out.long() if dtype.kind == "i" else out.float()


def loss_fn_config(request) -> dict[str, Any]:
    """``loss_fn_config_v2`` (numbers and strings) when present, else the legacy numbers-only map."""
    if len(request.loss_fn_config_v2):
        return {
            k: (v.number if v.WhichOneof("value") == "number" else v.text) for k, v in request.loss_fn_config_v2.items()
        }
    return dict(request.loss_fn_config)


LOSS_FN_INPUTS = {"target_tokens", "weights", "logprobs", "advantages", "mask"}
"""The per-token fields a datum may carry here: what edurl's losses read."""


def datums_from_request(request, rl: bool) -> list[Datum]:
    """edurl Datums from a ForwardBackwardRequest.

    Tinker's RL losses sum over every position; the prompt's positions carry advantage 0, so they add nothing.
    edurl's losses take an explicit ``mask``: a datum without one gets 1 everywhere, which is Tinker's sum.
    """
    if not request.data:
        raise WireError("forward_backward needs at least one datum")
    datums = []
    for i, d in enumerate(request.data):
        where = f"data[{i}]"
        tokens = tokens_from_chunks(d.model_input, f"{where}.model_input")
        if not tokens:
            raise WireError(f"{where}.model_input is empty")
        unknown = sorted(set(d.loss_fn_inputs) - LOSS_FN_INPUTS)
        if unknown:  # e.g. per-token clip thresholds, which the losses here would not read
            raise WireError(
                f"{where}.loss_fn_inputs has {unknown}, which edurl's losses do not read; they read "
                f"{sorted(LOSS_FN_INPUTS)} (a clip range goes in loss_fn_config)"
            )
        inputs = {key: tensor_to_torch(t, f"{where}.loss_fn_inputs[{key!r}]") for key, t in d.loss_fn_inputs.items()}
        for key, value in inputs.items():
            if value.dim() != 1:
                raise WireError(
                    f"{where}.loss_fn_inputs[{key!r}] has shape {list(value.shape)}; send one value per token"
                )
        if rl and "mask" not in inputs:
            inputs["mask"] = torch.ones(len(tokens))
        try:
            datums.append(Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs=inputs))
        except (TypeError, ValueError) as exc:
            raise WireError(f"{where}: {exc}") from None
    return datums


def batched_tensor(per_datum: list[torch.Tensor]):
    """A BatchedTensor of float32 values: all datums' values and the byte offset where each one starts."""
    arrays = [np.ascontiguousarray(t.detach().cpu().float().numpy(), dtype="<f4").reshape(-1) for t in per_datum]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8")
    return pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32
    )


def metric_key(name: str, reduction: str) -> str:
    """Tinker's metric keys are ``name:reduction`` with exactly one colon (the SDK merges chunks by reduction)."""
    return f"{name.replace(':', '/')}:{reduction}"


def forward_backward_output(logprobs: list[torch.Tensor], loss: float, metrics: dict[str, float]) -> bytes:
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(logprobs)
    record.fields["logprobs"].CopyFrom(batched_tensor(logprobs))
    out.metrics[metric_key("loss", "sum")] = float(loss)
    for name, value in metrics.items():
        out.metrics[metric_key(name, "mean")] = float(value)
    return out.SerializeToString()


def sample_response(sequences, prompt_logprobs: list[float] | None = None) -> bytes:
    """A SampleResponse: each sequence's tokens (int32), log-probs (float32) and stop reason."""
    out = pb.SampleResponse()
    for seq in sequences:
        s = out.sequences.add()
        s.stop_reason = pb.STOP_REASON_LENGTH if seq.stop_reason == "length" else pb.STOP_REASON_STOP
        s.tokens = np.asarray(seq.tokens, dtype="<i4").tobytes()
        s.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    return out.SerializeToString()
