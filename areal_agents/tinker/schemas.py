"""The JSON bodies the Tinker SDK (0.38) sends, as pydantic models, and the replies it parses.

A body that does not fit is a `SchemaError` naming the field (the server answers 400 with ``{"detail": ...}``):
never 409, 429 or 5xx, which the SDK retries for minutes. Unknown fields are refused, as the SDK's own
request models refuse them; options this server does not implement are refused by name, not ignored.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from areal_agents.engines.model_server.guard import BodyError
from areal_agents.engines.model_server.guard import parse_body as parse_json_body
from areal_agents.errors import RequestError
from areal_agents.tinker.losses import not_served

ModelT = TypeVar("ModelT", bound=BaseModel)
MAX_SAMPLES = 1024  # num_samples of one asample


class SchemaError(RequestError):
    """A JSON body that does not fit its schema; the message names the field."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, protected_namespaces=())


def parse_body(model: type[ModelT], raw: bytes | str) -> ModelT:
    """``raw`` JSON as ``model``; `SchemaError` naming the first bad field."""
    try:  # serve-model's parser: a body nested past Python's parser or holding a lone surrogate is a 400 too
        raw = raw.encode() if isinstance(raw, str) else raw
        data = parse_json_body(raw) if raw.strip() else None
    except BodyError as e:
        raise SchemaError(f"body: expects a JSON object, got invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise SchemaError(f"body: expects a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        got = f" (got {err['input']!r})" if err["type"] != "missing" and len(repr(err["input"])) <= 80 else ""
        raise SchemaError(f"{where}: {err['msg']}{got}") from None


class ClientConfigRequest(_Body):
    sdk_version: str | None = None


class CreateSessionRequest(_Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None
    type: Literal["create_session"] = "create_session"


class SessionHeartbeatRequest(_Body):
    session_id: str
    type: Literal["session_heartbeat"] = "session_heartbeat"


class FinishReason(_Body):
    type: Literal["success", "errored", "interrupted"]


class FinishSessionRequest(_Body):
    reason: FinishReason | None = None
    detail: str | None = None


class LoraConfig(_Body):
    rank: int = Field(ge=1, le=1024)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(_Body):
    type: Literal["adamw"] = Field("adamw", description="dimuon is not served: AdamW only")


class CreateModelRequest(_Body):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = OptimizerConfig()
    type: Literal["create_model"] = "create_model"


class GetInfoRequest(_Body):
    model_id: str
    type: Literal["get_info"] = "get_info"


class AdamParams(_Body):
    """AdamW with decoupled weight decay (as torch.optim.AdamW); ``grad_clip_norm`` 0 means no clipping."""

    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStepRequest(_Body):
    adam_params: AdamParams
    model_id: str
    seq_id: int | None = None
    type: Literal["optim_step"] = "optim_step"


class SaveWeightsRequest(_Body):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSamplerRequest(_Body):
    """Named (``path``: a sampler_weights checkpoint) or unnamed (``sampling_session_seq_id``: a new sampler)."""

    model_id: str
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"  # inflight is served as snapshot: the contract allows it
    seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"

    @model_validator(mode="after")
    def _one_form(self) -> SaveWeightsForSamplerRequest:
        if (self.path is None) == (self.sampling_session_seq_id is None):
            raise ValueError("expects exactly one of path (a named save) and sampling_session_seq_id (a sampler)")
        return self


class LoadWeightsRequest(_Body):
    """Into an existing model (``model_id``), or creating ``{session_id}:train:{model_seq_id}`` from it."""

    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0)
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: None = None  # external weights are not served
    type: Literal["load_weights"] = "load_weights"

    @model_validator(mode="after")
    def _one_form(self) -> LoadWeightsRequest:
        creates = self.session_id is not None and self.model_seq_id is not None
        if (self.model_id is not None) == creates or (self.session_id is None) != (self.model_seq_id is None):
            raise ValueError("expects either model_id, or session_id with model_seq_id (to create the model)")
        return self


class CreateSamplingSessionRequest(_Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None
    type: Literal["create_sampling_session"] = "create_sampling_session"

    @model_validator(mode="after")
    def _a_model(self) -> CreateSamplingSessionRequest:
        if self.base_model is None and self.model_path is None:
            raise ValueError("expects base_model or model_path")
        return self


class EncodedTextChunk(_Body):
    tokens: list[int] = Field(min_length=1)
    type: Literal["encoded_text"] = "encoded_text"

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type", "encoded_text") if isinstance(data, dict) else None
        if kind != "encoded_text":
            raise ValueError(f"expects an encoded_text chunk (this server takes token ids only), got {kind!r}")
        return data


class ModelInput(_Body):
    chunks: list[EncodedTextChunk] = Field(min_length=1)

    def tokens(self) -> list[int]:
        """The chunks' tokens, concatenated."""
        return [t for chunk in self.chunks for t in chunk.tokens]


class SamplingParams(_Body):
    """``stop``: None stops at EOS; ``[]`` never stops early; strings or token ids stop there."""

    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("expects -1 (off) or >= 1")
        return v


class SampleRequest(_Body):
    num_samples: int = Field(1, ge=1, le=MAX_SAMPLES)
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: Literal[0] = 0  # the options below are not served: refused by name, not ignored
    topk_sample_logprobs: Literal[0] = 0
    target_prompt_logprobs: None = None
    prompt_alt_tokens_k: Literal[0] = 0
    prompt_logprobs_last_n: None = None
    record_stability_info: bool | None = None
    type: Literal["sample"] = "sample"

    @field_validator("record_stability_info")
    @classmethod
    def _no_stability_records(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError(f"not served: {not_served('stable_reinforce')}")
        return v


class RetrieveFutureRequest(_Body):
    request_id: str
    allow_metadata_only: bool = False


def client_config_reply() -> dict[str, Any]:
    """How the server steers the SDK: one forward_backward body per call (our FIFO then keeps seq_id order)."""
    return {
        "pjwt_auth_enabled": False,
        "parallel_fwdbwd_chunks": False,
        "proto_compress_fwdbwd": False,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "sample_join_sampling_session": False,
    }


def get_info_reply(model_id: str, base_model: str, lora_rank: int, arch: str, tokenizer_id: str) -> dict[str, Any]:
    """``get_info``: ``model_name`` feeds ``get_tokenizer()``; ``tokenizer_id`` is cut at its first ':'."""
    return {
        "type": "get_info",
        "model_id": model_id,
        "is_lora": True,
        "lora_rank": lora_rank,
        "optimizer_config": {"type": "adamw"},
        "model_data": {"arch": arch, "model_name": base_model, "tokenizer_id": tokenizer_id},
    }


def capabilities_reply(base_models: list[str]) -> dict[str, Any]:
    """``get_server_capabilities``: every base model, trainable and sampleable."""
    models = [{"model_name": n, "trainable": True, "sampleable": True} for n in base_models]
    return {"supported_models": models}


def future_reply(request_id: str, model_id: str | None = None, sample_ids: list[str] | None = None) -> dict[str, Any]:
    """An ``UntypedAPIFuture``; an asample's must list one sequence id per sample (the SDK asserts it)."""
    reply: dict[str, Any] = {"request_id": request_id}
    if model_id is not None:
        reply["model_id"] = model_id
    if sample_ids is not None:
        reply["sample_sequence_ids"] = sample_ids
    return reply


def try_again_reply(request_id: str) -> dict[str, Any]:
    """The poll's answer when the result is not ready yet; the SDK polls again at once."""
    return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
