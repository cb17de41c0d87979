"""The v2 routes of the env-step server: any env, one action per acting agent, and closing by owner.

A session holds every agent of a `MultiAgentTextEnv` episode, or a single-agent env as the one agent
``"agent"``. A step carries exactly the actions of the session's ``acting`` agents (who acts next, the
env's turn order); anything else is refused before the env sees it, and the session stays usable.
``DELETE /v2/sessions?owner=NAME`` closes every session a run opened (docs/env-protocol.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import Response

from areal_agents.envs.runtime.protocol import (
    OWNER_PATTERN,
    SINGLE_AGENT,
    CreateSession,
    ErrorRecord,
    ErrorResponse,
    HTTPError,
    MultiBatchStepRequest,
    MultiBatchStepResult,
    MultiStepRequest,
    MultiStepResult,
    OwnerClosed,
    SessionClosed,
    SessionCreatedV2,
    reply,
)
from areal_agents.envs.runtime.sessions import EnvServer, Session


async def create(server: EnvServer, req: CreateSession) -> SessionCreatedV2:
    sid, session, (observations, infos) = await server.open(req)
    if not session.env.multi_agent:
        observations, infos = {SINGLE_AGENT: observations}, {SINGLE_AGENT: infos}
    elif not session.acting:
        await server.close(sid)
        raise HTTPError(500, "env_error", f"{req.env_id}: reset left no agent acting (acting_agents() is empty)")
    return reply(
        SessionCreatedV2,
        session_id=sid,
        multi_agent=session.env.multi_agent,
        agents=session.agents,
        acting=session.acting,
        observations=observations,
        infos=infos,
    )


def _check_actions(server: EnvServer, sid: str, session: Session, actions: dict[str, str]) -> None:
    """Refuse a step whose actions are not exactly the acting agents', or one too long (nothing changes)."""
    server.check_ready(sid, session)
    acting = session.acting
    missing = [a for a in acting if a not in actions]
    unexpected = sorted(set(actions) - set(acting))
    if missing or unexpected:
        raise HTTPError(
            400,
            "bad_request",
            f"actions: expects one per acting agent {acting} of session {sid}; missing {missing}, "
            f"unexpected {unexpected}",
        )
    for agent, action in actions.items():
        server.check_action(action, f"the action of {agent!r}")


def _result(sid: str, session: Session, out: tuple) -> MultiStepResult:
    """The env's step result as per-agent dicts (a single-agent env's under ``"agent"``)."""
    if not session.env.multi_agent:
        observation, reward, terminated, truncated, info = out
        out = ({SINGLE_AGENT: observation}, {SINGLE_AGENT: reward}, {SINGLE_AGENT: terminated})
        out = (*out, {SINGLE_AGENT: truncated}, {SINGLE_AGENT: info})
    observations, rewards, terminations, truncations, infos = out
    return reply(
        MultiStepResult,
        session_id=sid,
        observations={str(a): str(o) for a, o in observations.items()},
        rewards={str(a): float(r) for a, r in rewards.items()},
        terminations={str(a): bool(t) for a, t in terminations.items()},
        truncations={str(a): bool(t) for a, t in truncations.items()},
        infos={str(a): i for a, i in infos.items()},
        acting=[],
        error=None,
    )


def failed(sid: str, type_: str, message: str) -> MultiStepResult:
    """A `MultiStepResult` for a step that did not happen normally; the episode is over."""
    error = reply(ErrorRecord, type=type_, message=message)
    empty: dict[str, Any] = {}
    return reply(
        MultiStepResult,
        session_id=sid,
        observations=empty,
        rewards=empty,
        terminations=empty,
        truncations=empty,
        infos=empty,
        acting=[],
        error=error,
    )


async def step(server: EnvServer, sid: str, actions: dict[str, str]) -> MultiStepResult:
    session = server._get(sid)
    _check_actions(server, sid, session, actions)
    out = await server.advance(sid, session, actions if session.env.multi_agent else actions[SINGLE_AGENT])
    if isinstance(out, ErrorRecord):
        return failed(sid, out.type, out.message)
    try:
        result = _result(sid, session, out)
        if not session.env.multi_agent and (result.terminations[SINGLE_AGENT] or result.truncations[SINGLE_AGENT]):
            server.ended(session)
        result.acting = session.acting
    except (TypeError, ValueError, AttributeError) as e:  # the env's own result is malformed: its episode ends
        await server.close(sid)
        return failed(sid, "env_error", f"{session.env_id} step returned a malformed result: {type(e).__name__}: {e}")
    if not result.acting and not session.done:
        server.ended(session)
    return result


async def step_batch(server: EnvServer, req: MultiBatchStepRequest) -> MultiBatchStepResult:
    ids = [item.session_id for item in req.steps]
    if len(set(ids)) != len(ids):
        raise HTTPError(400, "bad_request", "steps: each session may appear once per batch")

    async def one(item: Any) -> MultiStepResult:
        try:
            return await step(server, item.session_id, item.actions)
        except HTTPError as e:
            return failed(item.session_id, e.type, e.message)

    return reply(MultiBatchStepResult, results=await asyncio.gather(*(one(item) for item in req.steps)))


def add_v2_routes(app: FastAPI, server: EnvServer, errors: dict[int, Any], as_json: Callable[..., Response]) -> None:
    """The ``/v2/...`` endpoints of ``server`` on ``app`` (beside v1's)."""

    @app.post("/v2/sessions", response_model=SessionCreatedV2, responses={**errors, 429: {"model": ErrorResponse}})
    async def create_v2(req: CreateSession) -> Response:
        return as_json(await create(server, req))

    @app.post("/v2/sessions/{session_id}/step", response_model=MultiStepResult, responses=errors)
    async def step_v2(session_id: str, req: MultiStepRequest) -> Response:
        return as_json(await step(server, session_id, req.actions))

    @app.post("/v2/step", response_model=MultiBatchStepResult, responses=errors)
    async def step_batch_v2(req: MultiBatchStepRequest) -> Response:
        return as_json(await step_batch(server, req))

    @app.delete("/v2/sessions/{session_id}", response_model=SessionClosed, responses=errors)
    async def close_v2(session_id: str) -> Response:
        return as_json(await server.close(session_id))

    @app.delete("/v2/sessions", response_model=OwnerClosed, responses=errors)
    async def close_owner(owner: str = Query(pattern=OWNER_PATTERN, description="the sessions' owner")) -> Response:
        return as_json(await server.close_owner(owner))
