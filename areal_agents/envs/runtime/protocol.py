"""The env-step protocol: plain JSON over HTTP, the same for every client language.

These pydantic models are the request/response bodies (and the server's OpenAPI schema). Errors are
``{"error": {"type": ..., "message": ...}}`` with a 4xx status; an env that fails mid-episode is not an
HTTP error but a `StepResult` whose ``error`` is set (``env_error``, ``timeout``, ``worker_died``) and
whose episode is over. v1 (``/v1/...``) steps one text action of a single-agent env; v2 (``/v2/...``) steps
one action per acting agent of any env (a single-agent env is the one agent ``"agent"``). See
docs/env-protocol.md.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

PROTOCOL_VERSION = "v2"  # the newest this server speaks; it serves every version of PROTOCOLS
PROTOCOLS = ["v1", "v2"]
SINGLE_AGENT = "agent"  # the agent id of a single-agent env over v2
OWNER_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
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
    owner: str | None = Field(
        default=None,
        pattern=OWNER_PATTERN,
        description="the client run that owns the session (1..128 of [A-Za-z0-9_.:-]); "
        "DELETE /v2/sessions?owner= closes all of its sessions",
    )


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


class SessionCreatedV2(BaseModel):
    session_id: str
    multi_agent: bool = Field(description="false: a single-agent env served as the one agent 'agent'")
    agents: list[str] = Field(description="every agent id of the episode, in a fixed order")
    acting: list[str] = Field(description="who acts next, in order (never empty after a reset)")
    observations: dict[str, str] = Field(description="per agent that gets one (at least every acting agent)")
    infos: dict[str, dict[str, Any]]


class MultiStepRequest(_Strict):
    actions: dict[str, str] = Field(description="one text action per acting agent: keys exactly the session's acting")


class MultiBatchItem(_Strict):
    session_id: str
    actions: dict[str, str]


class MultiBatchStepRequest(_Strict):
    steps: list[MultiBatchItem] = Field(description="one step per session; sessions must be distinct")


class MultiStepResult(BaseModel):
    session_id: str
    observations: dict[str, str] = Field(default_factory=dict, description="every agent with a new observation")
    rewards: dict[str, float] = Field(default_factory=dict, description="at least every agent that acted; missing: 0")
    terminations: dict[str, bool] = Field(default_factory=dict)
    truncations: dict[str, bool] = Field(default_factory=dict)
    infos: dict[str, dict[str, Any]] = Field(default_factory=dict)
    acting: list[str] = Field(default_factory=list, description="who acts next; [] when the episode is over")
    error: ErrorRecord | None = Field(default=None, description="set when this step failed; the episode is over")


class MultiBatchStepResult(BaseModel):
    results: list[MultiStepResult]


class OwnerClosed(BaseModel):
    owner: str
    closed: int = Field(description="how many open sessions of this owner were closed (may be 0)")


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
    protocol: str = Field(description=f"the newest env-step protocol version the server speaks ({PROTOCOL_VERSION})")
    protocols: list[str] = Field(description=f"every version it serves ({', '.join(PROTOCOLS)})")
    sessions_open: int
    limits: Limits


class ErrorResponse(BaseModel):
    error: ErrorRecord


class HTTPError(Exception):
    """A refusal: the status, the error type and the message of an `ErrorResponse`."""

    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message


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
