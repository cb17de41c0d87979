"""The Tinker REST API (``/api/v1``) as the ``tinker`` 0.38 SDK speaks it, over a `TinkerService`.

Status codes: a body the client got wrong is a 400 ``{"detail": "<field>: ..."}`` (never 409, 429 or 5xx,
which the SDK retries for minutes, nor an empty 400, which it takes for a proxy's), an unknown id 404, a
heartbeat of a finished session 410 (it stops the SDK's heartbeat). What goes wrong while a request runs is
its future's ``{"error", "category": "user"}``. ``retrieve_future`` holds the poll up to ``poll_s`` before it
answers ``try_again`` (the SDK polls again at once), and answers forward_backward and sample results as protobuf.
"""

from __future__ import annotations

import hmac
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from areal_agents.errors import RequestError
from areal_agents.net import BodyLimit
from areal_agents.tinker import schemas as s
from areal_agents.tinker.backend import TinkerService
from areal_agents.tinker.futures import TRY_AGAIN, FailedRequest, StoreFull
from areal_agents.tinker.ownership import NotFound, SessionFinished
from areal_agents.tinker.wire import decode_forward_backward

log = logging.getLogger(__name__)
PREFIX = "/api/v1"
POLL_S = 25.0  # retrieve_future's hold: under the SDK's 45 s read timeout
MAX_BODY_BYTES = 64 << 20
PROTOBUF = "application/x-protobuf"


def build_app(
    service: TinkerService, api_key: str | None = None, poll_s: float = POLL_S, max_body_bytes: int = MAX_BODY_BYTES
) -> FastAPI:
    """The app: every route the SDK calls, `X-API-Key` checked (``api_key``, or any ``tml-`` key when None)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await service.close()

    app = FastAPI(title="areal-agents serve-tinker", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if request.url.path == f"{PREFIX}/healthz":
            return await call_next(request)
        key = request.headers.get("x-api-key", "")
        ok = hmac.compare_digest(key.encode(), api_key.encode()) if api_key is not None else key.startswith("tml-")
        if not ok:
            return _detail(401, "X-API-Key: expects this server's key" if api_key else "X-API-Key: expects tml-...")
        return await call_next(request)

    # every body capped while it is read, chunked ones too: no more than the limit is ever held
    too_large = f"body: expects at most {max_body_bytes} bytes"
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, refuse=lambda n: _detail(413, too_large))

    @app.exception_handler(NotFound)
    async def not_found(request: Request, e: NotFound) -> Response:
        finished = isinstance(e, SessionFinished) and request.url.path.endswith("/session_heartbeat")
        return _detail(410 if finished else 404, str(e))

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, e: RequestError) -> Response:
        return _detail(400, str(e))

    @app.exception_handler(StoreFull)
    async def full(_: Request, e: StoreFull) -> Response:
        return _detail(429, str(e))  # the server's limit, not the client's mistake: send it again later

    for add in (_session_routes, _service_routes, _future_and_info_routes):
        add(app, service, poll_s)
    return app


def _poster(app: FastAPI) -> Any:
    """``@post(path, model)``: a POST route whose handler gets the body parsed as ``model`` (raw bytes when None;
    a `SchemaError` is a 400) and returns a dict (JSON) or a `Response`."""

    def post(path: str, model: type | None = None) -> Any:
        def register(handler: Any) -> Any:
            async def route(request: Request) -> Response:
                body = await request.body()
                arg = body if model is None else s.parse_body(model, body)
                reply = await handler(arg)
                return reply if isinstance(reply, Response) else JSONResponse(reply)

            app.add_api_route(PREFIX + path, route, methods=["POST"], name=handler.__name__)
            return handler

        return register

    return post


def _session_routes(app: FastAPI, service: TinkerService, poll_s: float) -> None:
    """The handshake, heartbeats, telemetry and a session's finish."""
    post = _poster(app)

    @post("/client/config", s.ClientConfigRequest)
    async def client_config(_: s.ClientConfigRequest) -> dict:
        return s.client_config_reply()

    @post("/client/dynamic_config", s.ClientConfigRequest)
    async def dynamic_config(_: s.ClientConfigRequest) -> dict:
        return {}

    @post("/create_session", s.CreateSessionRequest)
    async def create_session(req: s.CreateSessionRequest) -> dict:
        session = service.sessions.create(req.tags, req.user_metadata)
        return {"session_id": session.session_id, "type": "create_session"}

    @post("/session_heartbeat", s.SessionHeartbeatRequest)
    async def heartbeat(req: s.SessionHeartbeatRequest) -> dict:
        service.sessions.heartbeat(req.session_id)
        return {"type": "session_heartbeat"}

    @post("/telemetry")
    async def telemetry(_: bytes) -> dict:
        return {"status": "accepted"}

    @app.post(PREFIX + "/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> dict:
        s.parse_body(s.FinishSessionRequest, await request.body() or b"{}")
        await service.finish_session(session_id)
        return {}


def _service_routes(app: FastAPI, service: TinkerService, poll_s: float) -> None:
    """Training models and samplers: each route hands its parsed body to the service's method for it."""
    post = _poster(app)
    routes: dict[str, tuple[type | None, Callable[[Any], Any]]] = {
        "/create_model": (s.CreateModelRequest, service.create_model),
        "/get_info": (s.GetInfoRequest, service.get_info),
        "/forward_backward": (None, lambda body: service.forward_backward(decode_forward_backward(body))),
        "/optim_step": (s.OptimStepRequest, service.optim_step),
        "/save_weights": (s.SaveWeightsRequest, service.save_weights),
        "/save_weights_for_sampler": (s.SaveWeightsForSamplerRequest, service.save_weights_for_sampler),
        "/load_weights": (s.LoadWeightsRequest, service.load_weights),
        "/create_sampling_session": (s.CreateSamplingSessionRequest, service.create_sampling_session),
        "/asample": (s.SampleRequest, service.sample),
    }
    for path, (model, method) in routes.items():
        post(path, model)(_calling(method, path.strip("/")))


def _calling(method: Callable[[Any], Any], name: str) -> Callable[[Any], Any]:
    """An async handler named ``name`` that answers ``method``'s reply (awaited when it is a coroutine)."""

    async def handler(arg: Any) -> Any:
        reply = method(arg)
        return await reply if inspect.isawaitable(reply) else reply

    handler.__name__ = name
    return handler


def _future_and_info_routes(app: FastAPI, service: TinkerService, poll_s: float) -> None:
    """retrieve_future (long-polled) and the GET routes."""
    post = _poster(app)

    @post("/retrieve_future", s.RetrieveFutureRequest)
    async def retrieve_future(req: s.RetrieveFutureRequest) -> Response:
        if req.request_id not in service.futures:
            raise NotFound(f"request_id: no request {req.request_id!r} on this server (or its session finished)")
        outcome = await service.futures.retrieve(req.request_id, poll_s)
        if outcome is TRY_AGAIN:
            return JSONResponse(s.try_again_reply(req.request_id))
        if isinstance(outcome, FailedRequest):
            return JSONResponse(outcome.to_json())
        if isinstance(outcome, bytes):
            return Response(outcome, media_type=PROTOBUF)
        return JSONResponse(outcome)

    @app.get(PREFIX + "/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict:
        return service.get_sampler(sampler_id)

    @app.get(PREFIX + "/training_runs/{run_id}")
    async def training_run(run_id: str) -> dict:
        return service.training_run(run_id)

    @app.get(PREFIX + "/get_server_capabilities")
    async def capabilities() -> dict:
        return s.capabilities_reply(service.base_models.names())

    @app.get(PREFIX + "/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}


def _detail(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)
