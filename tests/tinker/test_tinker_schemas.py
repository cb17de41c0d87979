"""The JSON bodies tinker 0.38 sends (as a stub server logged them, note issue 49) parse; mistakes name the field."""

from __future__ import annotations

import json

import pytest

from areal_agents.tinker.schemas import (
    CreateModelRequest,
    CreateSamplingSessionRequest,
    CreateSessionRequest,
    FinishSessionRequest,
    LoadWeightsRequest,
    OptimStepRequest,
    RetrieveFutureRequest,
    SampleRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    SchemaError,
    client_config_reply,
    future_reply,
    get_info_reply,
    parse_body,
    try_again_reply,
)

SAMPLE = {
    "num_samples": 2,
    "prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}, {"tokens": [3], "type": "encoded_text"}]},
    "sampling_params": {"max_tokens": 3, "stop": ["\n"], "temperature": 1.0, "top_k": -1, "top_p": 1.0},
    "sampling_session_id": "samp-x0",
    "seq_id": 0,
    "prompt_logprobs": False,
    "topk_prompt_logprobs": 0,
    "topk_sample_logprobs": 0,
    "prompt_alt_tokens_k": 0,
    "record_stability_info": False,
    "type": "sample",
}
MODEL = {"session_id": "s", "model_seq_id": 0, "base_model": "b"}


def body(model, data):
    return parse_body(model, json.dumps(data).encode())


def test_the_sdks_logged_bodies_parse():
    session = body(
        CreateSessionRequest, {"sdk_version": "0.38.0", "tags": [], "type": "create_session", "user_metadata": {}}
    )
    assert session.tags == []
    create = body(
        CreateModelRequest,
        {
            "base_model": "tiny-qwen3",
            "lora_config": {"rank": 8, "train_attn": True, "train_mlp": True, "train_unembed": True},
            "model_seq_id": 0,
            "optimizer_config": {"type": "adamw"},
            "session_id": "sess1",
            "type": "create_model",
        },
    )
    assert (create.lora_config.rank, create.lora_config.seed) == (8, None)
    optim = body(
        OptimStepRequest,
        {
            "adam_params": {"beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "grad_clip_norm": 0.0, "learning_rate": 0.001},
            "model_id": "sess1:train:0",
            "seq_id": 2,
            "type": "optim_step",
        },
    )
    assert optim.adam_params.learning_rate == 0.001 and optim.adam_params.weight_decay == 0.0
    save = body(
        SaveWeightsRequest, {"model_id": "m", "overwrite": False, "path": "c1", "seq_id": 6, "type": "save_weights"}
    )
    assert save.path == "c1"
    finish = body(FinishSessionRequest, {"detail": None, "reason": {"type": "success"}})
    assert finish.reason.type == "success"
    poll = body(RetrieveFutureRequest, {"allow_metadata_only": True, "request_id": "req-0"})
    assert poll.request_id == "req-0"


def test_sample_bodies_give_the_prompts_tokens_and_params():
    sample = body(SampleRequest, SAMPLE)
    assert sample.prompt.tokens() == [1, 2, 3]
    assert (sample.num_samples, sample.sampling_params.max_tokens, sample.sampling_params.stop) == (2, 3, ["\n"])
    for stop in (None, [], "\n", [7, 8]):
        assert body(SampleRequest, {**SAMPLE, "sampling_params": {"stop": stop}}).sampling_params.stop == stop


def test_both_forms_of_save_for_sampler_load_weights_and_create_sampling_session():
    named = {"kind": "snapshot", "model_id": "m", "path": "s1", "seq_id": 4, "type": "save_weights_for_sampler"}
    unnamed = {"kind": "inflight", "model_id": "m", "sampling_session_seq_id": 1, "seq_id": 5}
    assert body(SaveWeightsForSamplerRequest, named).path == "s1"
    assert body(SaveWeightsForSamplerRequest, unnamed).sampling_session_seq_id == 1
    with pytest.raises(SchemaError, match="body: Value error, expects exactly one of path"):
        body(SaveWeightsForSamplerRequest, {"model_id": "m"})
    create = {
        "model_seq_id": 1,
        "optimizer": True,
        "path": "tinker://r/weights/c1",
        "session_id": "s",
        "type": "load_weights",
    }
    legacy = {"model_id": "m", "seq_id": 3, "path": "tinker://r/weights/c1", "optimizer": False}
    assert body(LoadWeightsRequest, create).model_seq_id == 1
    assert body(LoadWeightsRequest, legacy).model_id == "m"
    for bad in (
        {**legacy, "session_id": "s", "model_seq_id": 1},
        {**legacy, "model_id": None},
        {**create, "model_seq_id": None},
    ):
        with pytest.raises(SchemaError, match="expects either model_id, or session_id with model_seq_id"):
            body(LoadWeightsRequest, {k: v for k, v in bad.items() if v is not None})
    path = {"model_path": "tinker://r/sampler_weights/s1", "sampling_session_seq_id": 0, "session_id": "s"}
    assert body(CreateSamplingSessionRequest, path).model_path.endswith("/s1")
    with pytest.raises(SchemaError, match="expects base_model or model_path"):
        body(CreateSamplingSessionRequest, {"sampling_session_seq_id": 0, "session_id": "s"})


@pytest.mark.parametrize(
    ("model", "data", "message"),
    [
        (
            CreateModelRequest,
            {**MODEL, "optimizer_config": {"type": "dimuon"}},
            "optimizer_config.type: Input should be 'adamw'",
        ),
        (
            CreateModelRequest,
            {**MODEL, "lora_config": {"rank": 0}},
            "lora_config.rank: Input should be greater than or equal to 1",
        ),
        (CreateModelRequest, {"session_id": "s", "model_seq_id": 0}, "base_model: Field required"),
        (CreateModelRequest, {**MODEL, "colour": 1}, "colour: Extra inputs are not permitted"),
        (OptimStepRequest, {"model_id": "m", "optimizer_params": {"type": "dimuon"}}, "adam_params: Field required"),
        (
            OptimStepRequest,
            {"model_id": "m", "adam_params": {"beta1": 1.0}},
            "adam_params.beta1: Input should be less than 1",
        ),
        (
            OptimStepRequest,
            {"model_id": "m", "adam_params": {"learning_rate": float("nan")}},
            "adam_params.learning_rate: Input should be a finite number",
        ),
        (
            SampleRequest,
            {**SAMPLE, "prompt": {"chunks": [{"type": "image", "data": "eA==", "format": "png"}]}},
            "prompt.chunks.0: Value error, expects an encoded_text chunk",
        ),
        (SampleRequest, {**SAMPLE, "prompt": {"chunks": []}}, "prompt.chunks: List should have at least 1 item"),
        (
            SampleRequest,
            {**SAMPLE, "sampling_params": {"max_tokens": 0}},
            "sampling_params.max_tokens: Input should be greater than or equal to 1",
        ),
        (
            SampleRequest,
            {**SAMPLE, "sampling_params": {"top_k": 0}},
            "sampling_params.top_k: Value error, expects -1 (off) or >= 1",
        ),
        (SampleRequest, {**SAMPLE, "num_samples": 100000}, "num_samples: Input should be less than or equal to 1024"),
        (SampleRequest, {**SAMPLE, "topk_prompt_logprobs": 5}, "topk_prompt_logprobs: Input should be 0"),
        (
            SampleRequest,
            {**SAMPLE, "record_stability_info": True},
            "record_stability_info: Value error, not served: stable_reinforce",
        ),
        (SampleRequest, {**SAMPLE, "sampling_session_id": None}, "sampling_session_id: Input should be a valid string"),
    ],
)
def test_mistakes_name_the_field(model, data, message):
    with pytest.raises(SchemaError) as info:
        body(model, data)
    assert str(info.value).startswith(message), str(info.value)


def test_bodies_that_are_not_json_objects_are_schema_errors():
    with pytest.raises(SchemaError, match="body: expects a JSON object, got invalid JSON"):
        parse_body(SampleRequest, b"{nope")
    with pytest.raises(SchemaError, match="body: expects a JSON object, got list"):
        parse_body(SampleRequest, b"[1]")
    with pytest.raises(SchemaError, match="body: expects a JSON object, got NoneType"):
        parse_body(SampleRequest, b"")


def test_replies_have_the_fields_the_sdk_reads():
    assert client_config_reply()["parallel_fwdbwd_chunks"] is False  # one body per forward_backward: FIFO order holds
    info = get_info_reply("s:train:0", "tiny-qwen3", 8, "qwen3", "/tok")
    assert info["model_data"] == {"arch": "qwen3", "model_name": "tiny-qwen3", "tokenizer_id": "/tok"}
    assert future_reply("req-1", sample_ids=["a", "b"]) == {"request_id": "req-1", "sample_sequence_ids": ["a", "b"]}
    assert try_again_reply("req-1")["type"] == "try_again"
