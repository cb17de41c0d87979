"""The Tinker SDK's protobuf bodies: the forward_backward request in, its output and sample results out.

Arrays travel as raw little-endian bytes: tokens int32, loss inputs float32 or int64, outputs float32.
A result's per-datum outputs are concatenated into one ``BatchedTensor`` whose ``offsets`` are BYTE offsets
(n + 1 int64s from 0), as ``tinker/proto/response_conv.py`` reads them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from google.protobuf.message import DecodeError

from areal_agents.errors import RequestError
from areal_agents.tinker._vendor import tinker_public_pb2 as pb

LossConfigValue = float | str
StopReason = Literal["stop", "length"]
_DTYPES = {pb.DTYPE_FLOAT32: (np.float32, torch.float32), pb.DTYPE_INT64: (np.int64, torch.int64)}
_STOP = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


class WireError(RequestError):
    """A body the client got wrong, with the field named (the server answers 400 or a failed future)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class WireDatum:
    """One training example: the concatenated input tokens and the loss's named inputs."""

    tokens: list[int]
    loss_fn_inputs: dict[str, torch.Tensor]


@dataclass(frozen=True)
class ForwardBackwardBatch:
    """A decoded ``ForwardBackwardRequest``; ``forward_only`` is the SDK's ``forward()``."""

    model_id: str
    seq_id: int
    datums: list[WireDatum]
    loss_fn: str
    loss_fn_config: dict[str, LossConfigValue]
    forward_only: bool


@dataclass(frozen=True)
class SampledSequence:
    """One sample: its tokens, their log-probs (same length) and why it stopped."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason


def decode_forward_backward(body: bytes) -> ForwardBackwardBatch:
    """Parse a ``forward_backward`` body; raises `WireError` naming the first bad field."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise WireError(
            "body", f"expects a tinker_public.ForwardBackwardRequest protobuf, got undecodable bytes ({e})"
        ) from e
    if not msg.model_id:
        raise WireError("model_id", "expects a model id, got an empty string")
    datums = [_datum(d, f"data[{i}]") for i, d in enumerate(msg.data)]
    return ForwardBackwardBatch(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        datums=datums,
        loss_fn=msg.loss_fn,
        loss_fn_config=_loss_config(msg),
        forward_only=msg.forward_only,
    )


def _datum(msg: pb.Datum, where: str) -> WireDatum:
    """One datum: its text chunks joined into tokens, its loss inputs as tensors."""
    tokens: list[int] = []
    for j, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(
                f"{where}.model_input[{j}]", f"expects an encoded_text chunk, got {kind or 'an empty chunk'}"
            )
        tokens += _array(chunk.encoded_text.tokens, np.int32, f"{where}.model_input[{j}].tokens").tolist()
    if not tokens:
        raise WireError(f"{where}.model_input", "expects at least one token, got none")
    inputs = {name: _tensor(t, f"{where}.loss_fn_inputs[{name!r}]") for name, t in msg.loss_fn_inputs.items()}
    return WireDatum(tokens=tokens, loss_fn_inputs=inputs)


def _array(raw: bytes, dtype: type, field: str) -> np.ndarray:
    """Little-endian bytes as a numpy array; their length must be a whole number of items."""
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise WireError(field, f"expects a multiple of {size} bytes ({np.dtype(dtype).name}), got {len(raw)}")
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)


def _tensor(msg: pb.Tensor, field: str) -> torch.Tensor:
    """A dense or CSR tensor as a dense torch tensor, its bytes checked against dtype and shape."""
    if msg.dtype not in _DTYPES:
        name = pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else str(msg.dtype)
        raise WireError(f"{field}.dtype", f"expects DTYPE_FLOAT32 or DTYPE_INT64, got {name}")
    np_dtype, torch_dtype = _DTYPES[msg.dtype]
    shape = list(msg.shape)
    if any(s < 0 for s in shape):
        raise WireError(f"{field}.shape", f"expects sizes >= 0, got {shape}")
    if msg.WhichOneof("encoding") == "sparse_csr":
        return _csr(msg.sparse_csr, shape, np_dtype, torch_dtype, field)
    values = _array(msg.dense, np_dtype, f"{field}.dense")
    if not shape:
        shape = [values.size]  # the SDK leaves shape unset only for 1-D data
    if math.prod(shape) != values.size:
        raise WireError(f"{field}.shape", f"shape {shape} holds {math.prod(shape)} values, got {values.size}")
    return torch.from_numpy(values.copy()).to(torch_dtype).reshape(shape)


def _csr(msg: pb.SparseCsr, shape: list[int], np_dtype: type, torch_dtype: torch.dtype, field: str) -> torch.Tensor:
    """A 2-D CSR tensor (int64 indices) as dense, its index arrays checked."""
    if len(shape) != 2:
        raise WireError(f"{field}.shape", f"a sparse_csr tensor expects a 2-D shape, got {shape}")
    values = _array(msg.values, np_dtype, f"{field}.sparse_csr.values")
    crow = _array(msg.crow_indices, np.int64, f"{field}.sparse_csr.crow_indices")
    col = _array(msg.col_indices, np.int64, f"{field}.sparse_csr.col_indices")
    ok = (
        crow.size == shape[0] + 1
        and col.size == values.size
        and crow[0] == 0
        and crow[-1] == values.size
        and bool(np.all(np.diff(crow) >= 0))
        and bool(np.all((col >= 0) & (col < shape[1])))
    )
    if not ok:
        raise WireError(f"{field}.sparse_csr", f"indices do not describe a CSR matrix of shape {shape}")
    dense = np.zeros(shape, dtype=np_dtype)
    rows = np.repeat(np.arange(shape[0]), np.diff(crow))
    dense[rows, col] = values
    return torch.from_numpy(dense).to(torch_dtype)


def _loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, LossConfigValue]:
    """``loss_fn_config_v2`` (numbers and strings) when sent, else the legacy float map."""
    if not msg.loss_fn_config_v2:
        return {k: float(v) for k, v in msg.loss_fn_config.items()}
    out: dict[str, LossConfigValue] = {}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is None:
            raise WireError(f"loss_fn_config_v2[{key!r}]", "expects a number or a text value, got neither")
        out[key] = float(value.number) if kind == "number" else value.text
    return out


def encode_forward_backward_output(
    outputs: Sequence[Mapping[str, torch.Tensor]], metrics: Mapping[str, float]
) -> bytes:
    """Per-datum float32 outputs (the same names for each datum) and ``name:reduction`` metrics as protobuf."""
    bad = [k for k in metrics if k.count(":") != 1]
    if bad:
        raise ValueError(f"metric keys must read 'name:reduction' (the SDK splits them at ':'), got {bad}")
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    names = list(outputs[0]) if outputs else []
    for i, datum in enumerate(outputs):
        if list(datum) != names:
            raise ValueError(
                f"every datum's outputs must have the same names: datum 0 has {names}, datum {i} {list(datum)}"
            )
    for name in names:
        record.fields[name].CopyFrom(_batched([d[name] for d in outputs], name))
    return msg.SerializeToString()


def _batched(tensors: list[torch.Tensor], name: str) -> pb.BatchedTensor:
    """Float32 tensors of one trailing shape concatenated, with the byte offset of each."""
    arrays = [t.detach().to("cpu", torch.float32).numpy() for t in tensors]
    trailing = list(arrays[0].shape[1:]) if arrays and arrays[0].ndim else []
    for a in arrays:
        if a.ndim == 0 or list(a.shape[1:]) != trailing:
            raise ValueError(
                f"output {name!r}: expects tensors [T_i, *{trailing}] for every datum, got {list(a.shape)}"
            )
    offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
    data = b"".join(a.astype("<f4").tobytes() for a in arrays)
    return pb.BatchedTensor(
        data=data, offsets=offsets.astype("<i8").tobytes(), dtype=pb.DTYPE_FLOAT32, trailing_shape=trailing
    )


def encode_sample_response(
    sequences: Sequence[SampledSequence], prompt_logprobs: Sequence[float | None] | None = None
) -> bytes:
    """Sampled sequences and, when asked, the prompt's log-probs (None or NaN where unscored, as at 0)."""
    msg = pb.SampleResponse()
    for i, seq in enumerate(sequences):
        if len(seq.logprobs) != len(seq.tokens):
            raise ValueError(f"sequence {i}: {len(seq.tokens)} tokens but {len(seq.logprobs)} logprobs")
        msg.sequences.add(
            stop_reason=_STOP[seq.stop_reason],
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(),
        )
    if prompt_logprobs is not None:
        values = [math.nan if v is None else float(v) for v in prompt_logprobs]
        if values:
            values[0] = math.nan  # no context predicts the first prompt token
        msg.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    return msg.SerializeToString()
