"""The env-step server's sessions: their table, lifecycle, owners, limits and accounting (no HTTP: `server`
puts the protocol's routes in front of an `EnvServer`).

Each session is one episode of a gymnasium env or a `MultiAgentTextEnv`, run by a `LocalEnvPool` (threads by
default, worker processes with ``--mode process``). Steps have a timeout; idle sessions expire; the number
of open sessions is capped. An env that raises, hangs or kills its worker ends its own episode with a typed
error record; the server and the other sessions carry on. A client's env loads only the datasets the
operator allowed at start and imports only ``--module``s.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from areal_agents.data.sources import ServedData, serving
from areal_agents.envs.registry import describe_envs
from areal_agents.envs.runtime.budget import call_deadline
from areal_agents.envs.runtime.pool import LocalEnvPool, PooledEnv, PoolMode
from areal_agents.envs.runtime.protocol import (
    PROTOCOL_VERSION,
    PROTOCOLS,
    SINGLE_AGENT,
    BatchStepRequest,
    BatchStepResult,
    CreateSession,
    ErrorRecord,
    Health,
    HTTPError,
    Limits,
    OwnerClosed,
    SessionClosed,
    SessionCreated,
    StepResult,
    reply,
)
from areal_agents.errors import ArealAgentsError, EnvError, UnknownEnvError
from areal_agents.importing import only_modules
from areal_agents.workers import RemoteError


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    mode: PoolMode = "thread"
    workers: int = 4
    step_timeout: float = 60.0
    idle_timeout: float = 600.0
    max_sessions: int = 4096
    max_action_chars: int = 65536
    max_body_bytes: int = 8 * 1024 * 1024
    modules: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)  # NAME=PATH, PATH or a hub id: what clients may load
    data_dirs: list[str] = field(default_factory=list)  # clients may load JSONL files under these, too


@dataclass
class Session:
    env: PooledEnv
    env_id: str
    last_used: float
    owner: str | None = None
    done: bool = False
    busy: bool = False

    @property
    def agents(self) -> list[str]:
        return list(self.env.agents) if self.env.multi_agent else [SINGLE_AGENT]

    @property
    def acting(self) -> list[str]:
        """Who acts next ([] once the episode is over); a single-agent env's one agent until it ends."""
        if self.done:
            return []
        return list(self.env.acting or []) if self.env.multi_agent else [SINGLE_AGENT]


class Metrics:
    """Counters, the last 10,000 step latencies and per-second step counts: bounded memory."""

    WINDOW_S = 10

    def __init__(self) -> None:
        self.counters: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.latencies: collections.deque[float] = collections.deque(maxlen=10_000)
        self.per_second: collections.deque[list[int]] = collections.deque(maxlen=self.WINDOW_S + 1)
        self.started = time.time()

    def step_done(self, seconds: float) -> None:
        self.counters["steps"] += 1
        self.latencies.append(seconds)
        now = int(time.monotonic())
        if self.per_second and self.per_second[-1][0] == now:
            self.per_second[-1][1] += 1
        else:
            self.per_second.append([now, 1])

    def snapshot(self, sessions_open: int) -> dict[str, Any]:
        now = int(time.monotonic())
        recent = sum(count for second, count in self.per_second if now - self.WINDOW_S <= second < now)
        window = min(self.WINDOW_S, max(time.time() - self.started, 1e-9))
        lat = np.array(self.latencies) * 1000 if self.latencies else np.zeros(1)
        return {
            "sessions_open": sessions_open,
            **{k: v for k, v in sorted(self.counters.items())},
            "steps_per_s": recent / window,
            "errors": dict(self.errors),
            "step_latency_ms": {f"p{q}": float(np.percentile(lat, q)) for q in (50, 90, 99)},
            "uptime_s": time.time() - self.started,
        }


class EnvServer:
    """Sessions, their lifecycle and accounting; `build_app` puts HTTP in front of it."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.served = ServedData.from_args(cfg.datasets, cfg.data_dirs)
        self.pool = LocalEnvPool(cfg.mode, cfg.workers, cfg.step_timeout, cfg.modules)
        self.sessions: dict[str, Session] = {}
        self.opening = 0  # creations between the cap check and their session's registration
        self.metrics = Metrics()

    def health(self) -> dict[str, Any]:
        """/health: the protocol version and the limits, so a client (or the conformance suite) knows them."""
        cfg = self.cfg
        limits = Limits(
            max_sessions=cfg.max_sessions,
            max_body_bytes=cfg.max_body_bytes,
            max_action_chars=cfg.max_action_chars,
            idle_timeout_s=cfg.idle_timeout,
        )
        health = Health(
            status="ok", protocol=PROTOCOL_VERSION, protocols=PROTOCOLS, sessions_open=len(self.sessions), limits=limits
        )
        return health.model_dump()

    # -- sessions ------------------------------------------------------------------------------

    async def create(self, req: CreateSession) -> SessionCreated:
        """A v1 session: a single-agent env (a multi-agent one is refused, naming v2)."""
        sid, _, (observation, info) = await self.open(req, multi_agent_ok=False)
        return reply(SessionCreated, session_id=sid, observation=observation, info=info)

    async def open(self, req: CreateSession, multi_agent_ok: bool = True) -> tuple[str, Session, tuple[Any, Any]]:
        """Make and reset the env of a new session: (its id, the session, the reset's result)."""
        open_or_opening = len(self.sessions) + self.opening
        if open_or_opening >= self.cfg.max_sessions:
            raise HTTPError(
                429,
                "too_many_sessions",
                f"{open_or_opening} sessions are open or opening, the cap is {self.cfg.max_sessions}; "
                "close finished sessions or start the server with a larger --max-sessions",
            )
        self.opening += 1  # the place is taken before the first await, so concurrent creations see it
        try:
            # a request imports nothing and opens no file the operator did not allow, not even through kwargs;
            # its env's own work stops at the step timeout (`call_deadline`)
            with only_modules(self.cfg.modules), serving(self.served), call_deadline(self.cfg.step_timeout):
                env = self._make(req)
                if env.multi_agent and not multi_agent_ok:
                    await env.aclose()
                    raise HTTPError(
                        400,
                        "bad_request",
                        f"{req.env_id} is a multi-agent env (agents {env.agents}): create it with POST /v2/sessions",
                    )
                result = await self._reset(env, req)
            sid = uuid.uuid4().hex
            session = self.sessions[sid] = Session(env, req.env_id, time.monotonic(), req.owner)
        finally:
            self.opening -= 1
        self.metrics.counters["sessions_created"] += 1
        return sid, session, result

    def _make(self, req: CreateSession) -> PooledEnv:
        """The env of a new session; a request may name only ids registered here or in a start-up module."""
        try:
            return self.pool.make(req.env_id, **req.kwargs)
        except UnknownEnvError as e:
            served = [env_id for env_id, _ in describe_envs()]
            raise HTTPError(404, "unknown_env", f"{e} This server serves: {', '.join(served)}") from None
        except ArealAgentsError as e:
            raise HTTPError(400, "bad_request", str(e)) from None
        except Exception as e:  # the env's constructor failed for a reason of its own
            raise HTTPError(500, "env_error", f"cannot make {req.env_id}: {type(e).__name__}: {e}") from None

    async def _reset(self, env: PooledEnv, req: CreateSession) -> tuple[Any, Any]:
        """The first observation; a reset that rejects the request's arguments is the client's mistake (400)."""
        try:
            return await env.areset(seed=req.seed, options=req.options)
        except EnvError as e:
            if _clients_mistake(e):
                error = HTTPError(400, "bad_request", f"reset failed: {e.detail}; check the kwargs, seed and options")
            else:
                error = HTTPError(500 if e.kind == "env_error" else 504, e.kind, f"reset failed: {e.detail}")
        except UnknownEnvError as e:
            error = HTTPError(404, "unknown_env", f"reset failed: {e}")
        except ArealAgentsError as e:
            error = HTTPError(400, "bad_request", f"reset failed: {e}")
        except BaseException:  # cancelled (the client went away): no session, no env left open
            await env.aclose()
            raise
        await env.aclose()
        raise error

    def _get(self, sid: str) -> Session:
        session = self.sessions.get(sid)
        if session is None:
            raise HTTPError(404, "unknown_session", f"no open session {sid!r} (closed, expired or never created)")
        return session

    def check_action(self, action: str, who: str = "action") -> None:
        if len(action) > self.cfg.max_action_chars:
            raise HTTPError(
                400,
                "action_too_long",
                f"{who} is {len(action)} characters; the limit is {self.cfg.max_action_chars} (--max-action-chars)",
            )

    @staticmethod
    def check_ready(sid: str, session: Session) -> None:
        """A step may start: the episode runs and no other step of it does."""
        if session.done:
            raise HTTPError(
                409, "episode_over", f"the episode of session {sid} has ended; close it or create a new one"
            )
        if session.busy:
            raise HTTPError(409, "session_busy", f"session {sid} is already running a step")

    async def advance(self, sid: str, session: Session, action: Any) -> tuple | ErrorRecord:
        """Run one env step of a ready session: the env's result, or the record of its failure (the session is
        then closed: the episode ends with a typed record; nothing else is affected)."""
        self.check_ready(sid, session)
        session.busy = True
        start = time.perf_counter()
        try:
            with serving(self.served), call_deadline(self.cfg.step_timeout):
                result = await session.env.astep(action)
        except EnvError as e:
            self.metrics.errors[e.kind] += 1
            await self._close(sid, "sessions_failed")
            return reply(ErrorRecord, type=e.kind, message=e.detail)
        finally:
            session.busy = False
        self.metrics.step_done(time.perf_counter() - start)
        session.last_used = time.monotonic()
        return result

    def ended(self, session: Session) -> None:
        session.done = True
        self.metrics.counters["episodes_completed"] += 1

    async def step(self, sid: str, action: str) -> StepResult:
        session = self._get(sid)
        if session.env.multi_agent:
            raise HTTPError(
                400,
                "bad_request",
                f"session {sid} holds the multi-agent env {session.env_id}: step it with POST /v2/sessions/{sid}/step",
            )
        self.check_action(action)
        out = await self.advance(sid, session, action)
        if isinstance(out, ErrorRecord):
            return _failed(sid, out.type, out.message)
        observation, reward, terminated, truncated, info = out
        if terminated or truncated:
            self.ended(session)
        return reply(
            StepResult,
            session_id=sid,
            observation=observation,
            reward=float(reward),
            terminated=bool(terminated),
            truncated=bool(truncated),
            info=info,
            error=None,
        )

    async def step_batch(self, req: BatchStepRequest) -> BatchStepResult:
        ids = [item.session_id for item in req.steps]
        if len(set(ids)) != len(ids):
            raise HTTPError(400, "bad_request", "steps: each session may appear once per batch")

        async def one(item: Any) -> StepResult:
            try:
                return await self.step(item.session_id, item.action)
            except HTTPError as e:
                return _failed(item.session_id, e.type, e.message)

        return reply(BatchStepResult, results=await asyncio.gather(*(one(item) for item in req.steps)))

    async def _close(self, sid: str, counter: str) -> None:
        session = self.sessions.pop(sid, None)
        if session is not None:
            self.metrics.counters[counter] += 1
            await session.env.aclose()

    async def close(self, sid: str) -> SessionClosed:
        self._get(sid)
        await self._close(sid, "sessions_closed")
        return reply(SessionClosed, session_id=sid, closed=True)

    async def close_owner(self, owner: str) -> OwnerClosed:
        """Close every open session created with ``owner`` (a run ending, or starting again after a crash)."""
        owned = [sid for sid, s in self.sessions.items() if s.owner == owner]
        for sid in owned:
            await self._close(sid, "sessions_closed")
        return reply(OwnerClosed, owner=owner, closed=len(owned))

    async def expire_idle(self) -> int:
        cutoff = time.monotonic() - self.cfg.idle_timeout
        stale = [sid for sid, s in self.sessions.items() if s.last_used < cutoff and not s.busy]
        for sid in stale:
            await self._close(sid, "sessions_expired")
        return len(stale)

    async def expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(self.cfg.idle_timeout / 4, 5.0)))
            await self.expire_idle()

    async def aclose(self) -> None:
        for sid in list(self.sessions):
            await self._close(sid, "sessions_closed")
        await self.pool.aclose()


def _clients_mistake(e: EnvError) -> bool:
    """A reset that raised TypeError or ValueError: the request's kwargs, seed or options do not fit the env."""
    cause = e.__cause__
    name = cause.type_name if isinstance(cause, RemoteError) else type(cause).__name__
    return e.kind == "env_error" and (isinstance(cause, TypeError | ValueError) or name in ("TypeError", "ValueError"))


def _failed(sid: str, type_: str, message: str) -> StepResult:
    """A `StepResult` for a step that did not happen normally; the episode is over."""
    error = reply(ErrorRecord, type=type_, message=message)
    return reply(StepResult, session_id=sid, observation="", reward=0.0, terminated=True, info={}, error=error)
