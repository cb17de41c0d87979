"""The Tinker protobuf codec against messages built by hand with the vendored schema (the SDK's own
request encoder and response decoders do the same byte layout: little-endian arrays, byte offsets)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from areal_agents.tinker._vendor import tinker_public_pb2 as pb
from areal_agents.tinker.wire import (
    SampledSequence,
    WireError,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)


def _tensor(values, dtype, shape=None) -> pb.Tensor:
    np_dtype = {pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_INT64: "<i8"}[dtype]
    msg = pb.Tensor(dense=np.asarray(values, dtype=np_dtype).tobytes(), dtype=dtype)
    if shape is not None:
        msg.shape.extend(shape)
    return msg


def _request(**overrides) -> pb.ForwardBackwardRequest:
    """What the SDK sends for forward_backward([datum], "cross_entropy") with tokens [1,2] + [3]."""
    msg = pb.ForwardBackwardRequest(model_id="s:train:0", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([1, 2], dtype="<i4").tobytes()
    datum.model_input.add().encoded_text.tokens = np.asarray([3], dtype="<i4").tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(_tensor([2, 3, 4], pb.DTYPE_INT64, [3]))
    datum.loss_fn_inputs["weights"].CopyFrom(_tensor([0.0, 1.0, 0.5], pb.DTYPE_FLOAT32, [3]))
    for key, value in overrides.items():
        setattr(msg, key, value)
    return msg


def test_a_request_decodes_to_tokens_and_typed_tensors():
    batch = decode_forward_backward(_request().SerializeToString())
    assert (batch.model_id, batch.seq_id, batch.loss_fn, batch.forward_only) == ("s:train:0", 1, "cross_entropy", False)
    (datum,) = batch.datums
    assert datum.tokens == [1, 2, 3]  # the chunks concatenated in order
    assert datum.loss_fn_inputs["target_tokens"].dtype == torch.int64
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4]
    assert datum.loss_fn_inputs["weights"].dtype == torch.float32
    assert datum.loss_fn_inputs["weights"].tolist() == [0.0, 1.0, 0.5]


def test_forward_only_and_a_tensor_without_shape_is_one_dimensional():
    msg = _request(forward_only=True)
    msg.data[0].loss_fn_inputs["advantages"].CopyFrom(_tensor([1.0, -1.0, 2.0], pb.DTYPE_FLOAT32))
    batch = decode_forward_backward(msg.SerializeToString())
    assert batch.forward_only is True
    assert batch.datums[0].loss_fn_inputs["advantages"].shape == (3,)


def test_loss_config_prefers_v2_with_text_values_and_falls_back_to_the_float_map():
    msg = _request()
    msg.loss_fn_config["clip_low_threshold"] = 0.8
    assert decode_forward_backward(msg.SerializeToString()).loss_fn_config == {"clip_low_threshold": pytest.approx(0.8)}
    msg.loss_fn_config_v2["clip_low_threshold"].number = 0.7
    msg.loss_fn_config_v2["mode"].text = "token"
    config = decode_forward_backward(msg.SerializeToString()).loss_fn_config
    assert config == {"clip_low_threshold": pytest.approx(0.7), "mode": "token"}


def test_a_two_dimensional_and_a_csr_tensor_decode_dense():
    msg = _request()
    msg.data[0].loss_fn_inputs["grid"].CopyFrom(_tensor([1, 2, 3, 4, 5, 6], pb.DTYPE_FLOAT32, [2, 3]))
    csr = msg.data[0].loss_fn_inputs["sparse"]
    csr.dtype, csr.shape[:] = pb.DTYPE_FLOAT32, [2, 3]
    csr.sparse_csr.values = np.asarray([5.0, 7.0], dtype="<f4").tobytes()
    csr.sparse_csr.crow_indices = np.asarray([0, 1, 2], dtype="<i8").tobytes()
    csr.sparse_csr.col_indices = np.asarray([2, 0], dtype="<i8").tobytes()
    inputs = decode_forward_backward(msg.SerializeToString()).datums[0].loss_fn_inputs
    assert inputs["grid"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert inputs["sparse"].tolist() == [[0, 0, 5], [7, 0, 0]]


def _bad(mutate) -> WireError:
    msg = _request()
    mutate(msg)
    with pytest.raises(WireError) as info:
        decode_forward_backward(msg.SerializeToString())
    return info.value


def test_bad_requests_name_the_field():
    assert _bad(lambda m: m.data[0].model_input.add().image.SetInParent()).field == "data[0].model_input[2]"
    err = _bad(lambda m: setattr(m.data[0].model_input[0].encoded_text, "tokens", b"\x01\x02\x03"))
    assert err.field == "data[0].model_input[0].tokens" and "multiple of 4" in err.message
    err = _bad(lambda m: m.data[0].loss_fn_inputs["weights"].shape.append(2))
    assert err.field == "data[0].loss_fn_inputs['weights'].shape" and "holds 6 values, got 3" in err.message
    err = _bad(lambda m: setattr(m.data[0].loss_fn_inputs["weights"], "dtype", pb.DTYPE_BFLOAT16))
    assert err.field == "data[0].loss_fn_inputs['weights'].dtype" and "DTYPE_BFLOAT16" in err.message
    assert _bad(lambda m: setattr(m, "model_id", "")).field == "model_id"
    assert _bad(lambda m: m.data[0].ClearField("model_input")).field == "data[0].model_input"
    assert _bad(lambda m: m.loss_fn_config_v2["x"].SetInParent()).field == "loss_fn_config_v2['x']"


def test_a_csr_tensor_with_an_index_out_of_range_is_refused():
    def mutate(m):
        t = m.data[0].loss_fn_inputs["s"]
        t.dtype, t.shape[:] = pb.DTYPE_FLOAT32, [1, 2]
        t.sparse_csr.values = np.asarray([1.0], dtype="<f4").tobytes()
        t.sparse_csr.crow_indices = np.asarray([0, 1], dtype="<i8").tobytes()
        t.sparse_csr.col_indices = np.asarray([2], dtype="<i8").tobytes()  # column 2 of 2

    assert _bad(mutate).field == "data[0].loss_fn_inputs['s'].sparse_csr"


def test_undecodable_bytes_are_a_wire_error():
    with pytest.raises(WireError, match="body: expects a tinker_public.ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff")


def test_outputs_concatenate_per_datum_with_byte_offsets():
    outputs = [{"logprobs": torch.tensor([-1.0, -2.0])}, {"logprobs": torch.tensor([-0.5, -0.25, -4.0])}]
    msg = pb.ForwardBackwardOutput.FromString(encode_forward_backward_output(outputs, {"loss:sum": 3.5}))
    assert msg.loss_fn_output_type == "ArrayRecord" and dict(msg.metrics) == {"loss:sum": 3.5}
    (record,) = msg.loss_fn_outputs
    field = record.fields["logprobs"]
    assert record.num_datums == 2 and field.dtype == pb.DTYPE_FLOAT32 and list(field.trailing_shape) == []
    assert np.frombuffer(field.offsets, "<i8").tolist() == [0, 8, 20]  # 2 and 3 float32s: bytes, not items
    assert np.frombuffer(field.data, "<f4").tolist() == [-1.0, -2.0, -0.5, -0.25, -4.0]


def test_outputs_refuse_metric_keys_the_sdk_cannot_split_and_ragged_names():
    with pytest.raises(ValueError, match="name:reduction"):
        encode_forward_backward_output([], {"loss": 1.0})
    with pytest.raises(ValueError, match="same names"):
        encode_forward_backward_output([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], {})


def test_an_empty_batch_encodes_zero_datums():
    msg = pb.ForwardBackwardOutput.FromString(encode_forward_backward_output([], {"loss:sum": 0.0}))
    assert msg.loss_fn_outputs[0].num_datums == 0 and not msg.loss_fn_outputs[0].fields


def test_a_sample_response_carries_tokens_logprobs_stop_reasons_and_prompt_logprobs():
    sequences = [SampledSequence([5, 6], [-0.5, -1.5], "stop"), SampledSequence([7], [-2.0], "length")]
    msg = pb.SampleResponse.FromString(encode_sample_response(sequences, [None, -1.0, -3.0]))
    assert [np.frombuffer(s.tokens, "<i4").tolist() for s in msg.sequences] == [[5, 6], [7]]
    assert [np.frombuffer(s.logprobs, "<f4").tolist() for s in msg.sequences] == [[-0.5, -1.5], [-2.0]]
    assert [s.stop_reason for s in msg.sequences] == [pb.STOP_REASON_STOP, pb.STOP_REASON_LENGTH]
    prompt = np.frombuffer(msg.prompt_logprobs, "<f4").tolist()
    assert math.isnan(prompt[0]) and prompt[1:] == [-1.0, -3.0]


def test_a_sample_response_without_prompt_logprobs_leaves_the_field_unset():
    msg = pb.SampleResponse.FromString(encode_sample_response([SampledSequence([1], [-1.0], "stop")]))
    assert not msg.HasField("prompt_logprobs")
    with pytest.raises(ValueError, match="1 tokens but 0 logprobs"):
        encode_sample_response([SampledSequence([1], [], "stop")])
