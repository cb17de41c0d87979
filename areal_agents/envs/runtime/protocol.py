"""The env-step protocol: plain JSON over HTTP, the same for every client language.

These pydantic models are the request/response bodies (and the server's OpenAPI schema). Errors are
``{"error": {"type": ..., "message": ...}}`` with a 4xx status; an env that fails mid-episode is not an
HTTP error but a `StepResult` whose ``error`` is set (``env_error``, ``timeout``, ``worker_died``) and
whose episode is over. See docs/env-protocol.md.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

PROTOCOL_VERSION = "v1"
ModelT = TypeVar("ModelT", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateSession(_Strict):
    env_id: str = Field(
        description="an id registered on the server (GET /v1/envs), e.g. areal_agents/Arithmetic-v0, or "
        "module:Class for a module the server imported at start"
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for gymnasium.make")
    seed: int | None = Field(
        default=None, ge=0, description="reset seed, an integer >= 0; the same seed gives the same episode"
    )
    options: dict[str, Any] | None = Field(default=None, description="reset options")


class SessionCreated(BaseModel):
    session_id: str
    observation: str
    info: dict[str, Any]


class StepRequest(_Strict):
    action: str = Field(description="the agent's text action")


class BatchItem(_Strict):
    session_id: str
    action: str


class BatchStepRequest(_Strict):
    steps: list[BatchItem] = Field(description="one action per session; sessions must be distinct")


class ErrorRecord(BaseModel):
    type: str = Field(
        description="bad_request | unknown_env | unknown_session | episode_over | payload_too_large | "
        "too_many_sessions ... (4xx); env_error | timeout | worker_died (the env failed)"
    )
    message: str


class StepResult(BaseModel):
    session_id: str
    observation: str = ""
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = Field(default_factory=dict)
    error: ErrorRecord | None = Field(default=None, description="set when this step failed; the episode is over")


class BatchStepResult(BaseModel):
    results: list[StepResult]


class SessionClosed(BaseModel):
    session_id: str
    closed: bool


class EnvInfo(BaseModel):
    id: str
    description: str


class EnvList(BaseModel):
    envs: list[EnvInfo]


class Limits(BaseModel):
    max_sessions: int = Field(description="open sessions at most; one more creation is 429 too_many_sessions")
    max_body_bytes: int = Field(description="request bodies at most; a larger one is 413 payload_too_large")
    max_action_chars: int = Field(description="an action's characters at most; a longer one is 400 action_too_long")
    idle_timeout_s: float = Field(description="a session with no step for this long is closed")


class Health(BaseModel):
    status: str
    protocol: str = Field(description=f"the env-step protocol version the server speaks ({PROTOCOL_VERSION})")
    sessions_open: int
    limits: Limits


class ErrorResponse(BaseModel):
    error: ErrorRecord


def reply(model: type[ModelT], **fields: Any) -> ModelT:
    """A reply of the protocol, built from its type without validation: ``info`` is the env's own dict, which
    `dumps` writes as it is (numpy values, non-string keys)."""
    return model.model_construct(**fields)


def _to_json_value(obj: Any) -> Any:
    if isinstance(obj, BaseModel):  # a reply: its fields in declaration order, the wire order
        return {name: getattr(obj, name) for name in type(obj).model_fields}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return repr(obj)


def dumps(payload: Any) -> bytes:
    """JSON of a reply (a model of this module, or plain values) with numpy values converted and anything else
    unknown shown as its repr (info dicts)."""
    return json.dumps(payload, default=_to_json_value, separators=(",", ":")).encode()
