"""The env-step server: env sessions (`sessions.EnvServer`) behind an asyncio HTTP API (FastAPI + uvicorn).

    areal-agents serve-env --port 8765 --workers 4            # then: RemoteEnvPool("http://127.0.0.1:8765")

v1's routes (here) step single-agent envs; v2's (`server_v2`) step any env, one action per acting agent,
and close a run's sessions by owner. Each session is one episode, run by a `LocalEnvPool` (threads by
default, worker processes with ``--mode process``); an env that raises, hangs or kills its worker ends its
own episode with a typed error record. A client's env loads only the datasets the operator allowed at start
(``--dataset``, ``--data-dir``, the bundled sets) and imports only ``--module``s.
"""

from __future__ import annotations

import asyncio
import gc
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from areal_agents.data.sources import ServedData, export_to_workers
from areal_agents.envs.registry import describe_envs
from areal_agents.envs.runtime.protocol import (
    PROTOCOL_VERSION,
    BatchStepRequest,
    BatchStepResult,
    CreateSession,
    EnvInfo,
    EnvList,
    ErrorRecord,
    ErrorResponse,
    Health,
    HTTPError,
    SessionClosed,
    SessionCreated,
    StepRequest,
    StepResult,
    dumps,
    reply,
)
from areal_agents.envs.runtime.server_v2 import add_v2_routes
from areal_agents.envs.runtime.sessions import EnvServer, ServerConfig, Session
from areal_agents.net import BodyLimit
from areal_agents.timeline import timeline_from_env


def _json(payload: Any, status: int = 200) -> Response:
    return Response(dumps(payload), status_code=status, media_type="application/json")


def _error(status: int, type_: str, message: str) -> Response:
    return _json(reply(ErrorResponse, error=reply(ErrorRecord, type=type_, message=message)), status)


def _too_large(max_bytes: int) -> Response:
    return _error(413, "payload_too_large", f"request body over {max_bytes} bytes (--max-body-bytes)")


def build_app(server: EnvServer) -> FastAPI:
    """The HTTP API of ``server``; its OpenAPI schema is served at /openapi.json."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        task = asyncio.create_task(server.expiry_loop())
        yield
        task.cancel()
        await server.aclose()

    app = FastAPI(title="areal-agents env-step server", version=PROTOCOL_VERSION, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=server.cfg.max_body_bytes, refuse=_too_large)
    errors = {400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}, 409: {"model": ErrorResponse}}

    @app.exception_handler(HTTPError)
    async def on_http_error(request: Request, exc: HTTPError) -> Response:
        server.metrics.errors[exc.type] += 1
        return _error(exc.status, exc.type, exc.message)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()))
            parts.append(f"{where}: {err.get('msg')}")
        server.metrics.errors["bad_request"] += 1
        return _error(400, "bad_request", "; ".join(parts) or "malformed request")

    @app.get("/health", response_model=Health)
    async def health() -> Response:
        return _json(server.health())

    @app.get("/metrics")
    async def metrics() -> Response:
        return _json(server.metrics.snapshot(len(server.sessions)))

    @app.get("/v1/envs", response_model=EnvList)
    async def list_envs() -> Response:
        envs = [reply(EnvInfo, id=i, description=d) for i, d in describe_envs()]
        return _json(reply(EnvList, envs=envs))

    @app.post("/v1/sessions", response_model=SessionCreated, responses={**errors, 429: {"model": ErrorResponse}})
    async def create(req: CreateSession) -> Response:
        return _json(await server.create(req))

    @app.post("/v1/sessions/{session_id}/step", response_model=StepResult, responses=errors)
    async def step(session_id: str, req: StepRequest) -> Response:
        return _json(await server.step(session_id, req.action))

    @app.delete("/v1/sessions/{session_id}", response_model=SessionClosed, responses=errors)
    async def close(session_id: str) -> Response:
        return _json(await server.close(session_id))

    @app.post("/v1/step", response_model=BatchStepResult, responses=errors)
    async def step_batch(req: BatchStepRequest) -> Response:
        return _json(await server.step_batch(req))

    add_v2_routes(app, server, errors, _json)
    return app


def dedicated_server(cfg: ServerConfig) -> EnvServer:
    """The env server of a process that exists to serve it (serve-env, an env-server actor): its allowed
    datasets hold for the whole process, so its ``--mode process`` workers load nothing else either."""
    export_to_workers(ServedData.from_args(cfg.datasets, cfg.data_dirs))
    return EnvServer(cfg)


def serve(cfg: ServerConfig) -> None:
    """Run the server until interrupted (``areal-agents serve-env``)."""
    import uvicorn

    timeline_from_env(f"serve-env-{cfg.port}")  # started by a run: its workers' busy time joins the run's timeline
    server = dedicated_server(cfg)
    app = build_app(server)
    # the modules' and libraries' objects, walked by no collection again: each step allocates enough to
    # trigger collections, and walking them cost about a third of the server's CPU per step
    gc.collect()
    gc.freeze()
    print(f"serving envs on http://{cfg.host}:{cfg.port} (mode {cfg.mode}, {cfg.workers} workers)", flush=True)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False)


__all__ = ["EnvServer", "HTTPError", "ServerConfig", "Session", "build_app", "dedicated_server", "serve"]
