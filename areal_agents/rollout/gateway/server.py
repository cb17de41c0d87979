"""The gateway's HTTP server: OpenAI's ``/v1/chat/completions`` and ``/v1/responses`` and Anthropic's
``/v1/messages`` in front of the run's engine, every call of a session captured token-in/token-out; the
``/rl/sessions`` routes open, end and reward sessions (docs/gateway.md).

A call names its session by an ``X-Session-Id`` header (a new id opens it, with the task key of an
``X-Session-Task`` header) or its path (``/s/SESSION/v1/...``: a client's ``base_url``); a call without one is
served and not captured. The server runs in the current event
loop, beside the engine it serves, whose weight updates pause and resume its calls as any rollout's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types.chat import ChatCompletion
from transformers import PreTrainedTokenizerBase

from areal_agents.agents.capture import ChatCapture
from areal_agents.agents.proxy import InLoopServer
from areal_agents.chat import ReplyParser
from areal_agents.config.gateway_section import GatewayConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.model_server.guard import BodyError, ClientGuard, parse_body, unless_gone
from areal_agents.engines.model_server.openai_routes import openai_error
from areal_agents.engines.model_server.openai_shapes import OpenAIRequestError
from areal_agents.errors import ArealAgentsError, EngineError, RequestError
from areal_agents.net import free_port
from areal_agents.rollout.gateway.anthropic_api import (
    anthropic_error,
    chat_kwargs_from_messages,
    message_from_completion,
)
from areal_agents.rollout.gateway.keys import ApiKeys, KeyPolicy, RateLimits
from areal_agents.rollout.gateway.responses_api import chat_kwargs_from_responses, response_from_completion
from areal_agents.rollout.gateway.session_book import FinishedSession, Session, SessionBook, SessionError
from areal_agents.rollout.gateway.streams import chat_events, message_events, response_events
from areal_agents.types import SamplingParams

MODEL_NAME = "areal-agents-policy"


def _chat_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """A chat completions body as it is: `ChatCapture.create` checks each field, but ``messages`` must be there."""
    if not isinstance(body.get("messages"), list):
        raise OpenAIRequestError("messages", "the body needs a list of chat messages")
    return dict(body)


def _chat_reply(completion: ChatCompletion, kwargs: dict[str, Any], model: str) -> dict[str, Any]:
    return completion.model_dump(exclude_none=True) | {"model": model}


@dataclass(frozen=True)
class _Api:
    """One API: its request as ChatCapture.create kwargs, the ChatCompletion as its reply, its error shape, and
    its reply as server-sent events (``stream: true``)."""

    to_chat: Callable[[dict[str, Any]], dict[str, Any]]
    reply: Callable[[ChatCompletion, dict[str, Any], str], dict[str, Any]]
    error: Callable[..., JSONResponse]
    events: Callable[[dict[str, Any], bool], Iterator[str]]


_APIS = {
    "chat": _Api(_chat_kwargs, _chat_reply, openai_error, chat_events),
    "responses": _Api(
        chat_kwargs_from_responses,
        lambda completion, kwargs, model: response_from_completion(completion, model),
        openai_error,
        lambda reply, usage: response_events(reply),
    ),
    "messages": _Api(
        chat_kwargs_from_messages,
        lambda completion, kwargs, model: message_from_completion(completion, kwargs.get("stop"), model),
        anthropic_error,
        lambda reply, usage: message_events(reply),
    ),
}
_ROUTES = {"chat": "chat/completions", "responses": "responses", "messages": "messages"}


class Gateway:
    """Sessions of `ChatCapture` behind OpenAI- and Anthropic-compatible routes; rewarded sessions go to
    ``on_ready`` as `FinishedSession` (the trainer's queue, or the trajectory store).

    gateway = Gateway(cfg, engine, tokenizer, SamplingParams(64), on_ready=queue.put_nowait)
    await gateway.start()            # clients: OpenAI(base_url=gateway.url + "/v1"), Anthropic(base_url=gateway.url)
    """

    def __init__(
        self,
        cfg: GatewayConfig,
        engine: InferenceEngine,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingParams,
        on_ready: Callable[[FinishedSession], None],
        *,
        parser: ReplyParser | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_total_tokens: int = 4096,
    ) -> None:
        self.cfg, self.engine, self.tokenizer, self.sampling = cfg, engine, tokenizer, sampling
        self.parser = parser or ReplyParser.for_template(tokenizer.chat_template)
        self.template_kwargs, self.max_total_tokens = dict(chat_template_kwargs or {}), max_total_tokens
        self.keys = ApiKeys.load(cfg.api_keys_file)
        self.limits = RateLimits()
        self.book = SessionBook(cfg, self._capture, on_ready)
        self.port = cfg.port or free_port(cfg.host)
        self.app = self._build_app()
        self._server: InLoopServer | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    async def start(self) -> None:
        """Serve on ``cfg.host:port`` in this event loop; sweep idle and expired sessions while serving."""
        # keep-alive past a training step's event-loop stalls: a client that reuses a connection the server just
        # closed gets a transport error (httpx does not retry it)
        config = uvicorn.Config(
            self.app, host=self.cfg.host, port=self.port, log_level="warning", lifespan="off", timeout_keep_alive=60
        )
        self._server = InLoopServer(config)
        serving = asyncio.create_task(self._server.serve())
        self._tasks = [serving, asyncio.create_task(self._sweep())]
        while not self._server.started:
            if serving.done():
                await self.stop()
                serving.result()  # the bind failed: raise its error
                raise ArealAgentsError(f"gateway on {self.cfg.host}:{self.port} stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        for task in self._tasks[1:]:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._server, self._tasks = None, []

    async def _sweep(self) -> None:
        every = min(5.0, self.cfg.session_idle_s / 4, self.cfg.reward_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            self.book.sweep()

    def _capture(self, session_id: str) -> ChatCapture:
        return ChatCapture(
            self.engine,
            self.tokenizer,
            self.sampling,
            episode_id=session_id,
            max_total_tokens=self.max_total_tokens,
            parser=self.parser,
        )

    async def _serve(self, api: str, request: Request, path_session: str | None) -> Response:
        """One model call of ``api``: authenticated, limited, converted, captured in its session, converted back."""
        spec, error = _APIS[api], _APIS[api].error
        try:
            key = self.keys.identify(request.headers.get("authorization"), request.headers.get("x-api-key"))
            self.limits.admit(key)
            body = parse_body(await request.body(), required=True)
            if not isinstance(body, dict):
                raise BodyError("expects a JSON object")
            stream = body.pop("stream", None)
            if stream not in (None, True, False):
                raise OpenAIRequestError("stream", f"expects true or false, got {stream!r}")
            options = body.get("stream_options")
            usage = bool(stream) and isinstance(options, dict) and options.get("include_usage") is True
            kwargs = spec.to_chat(body)
            kwargs["chat_template_kwargs"] = self.template_kwargs | (kwargs.get("chat_template_kwargs") or {})
            sid = path_session or request.headers.get("x-session-id")
            task = request.headers.get("x-session-task", "")
            session = self.book.session_for_call(sid, key.name, task) if sid else None
        except SessionError as e:
            return error(e.status, str(e), None)
        except BodyError as e:
            return error(400, str(e), e.field)
        except OpenAIRequestError as e:
            return error(400, str(e), e.param)
        model = body["model"] if isinstance(body.get("model"), str) else MODEL_NAME

        def respond(completion: ChatCompletion) -> Response:
            reply = spec.reply(completion, kwargs, model)
            if not stream:
                return JSONResponse(reply)
            return StreamingResponse(spec.events(reply, usage), media_type="text/event-stream")

        return await unless_gone(request.receive, self._generate(session, key, kwargs, respond, error))

    async def _generate(
        self,
        session: Session | None,
        key: KeyPolicy,
        kwargs: dict[str, Any],
        respond: Callable[[ChatCompletion], Response],
        error: Callable[..., JSONResponse],
    ) -> Response:
        if session is None:
            self.book.counts.unsessioned_calls += 1
        lock = session.lock if session is not None else contextlib.nullcontext()
        try:
            async with lock:
                capture = session.capture if session is not None else self._capture("unsessioned")
                completion = await capture.create(**kwargs)
        except OpenAIRequestError as e:
            return error(400, str(e), e.param)
        except (RequestError, ValueError, TypeError) as e:
            return error(400, str(e), None)
        except EngineError as e:
            return error(503, f"the engine could not serve the call: {e}", None)
        finally:
            if session is not None:
                self.book.call_finished(session)
        self.limits.spent(key, completion.usage.total_tokens if completion.usage else 0)
        return respond(completion)

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="areal-agents gateway")
        app.add_middleware(ClientGuard, max_body_bytes=self.cfg.max_body_bytes)
        for api, route in _ROUTES.items():
            app.add_api_route(f"/v1/{route}", self._route(api, False), methods=["POST"])
            app.add_api_route(f"/s/{{session}}/v1/{route}", self._route(api, True), methods=["POST"])
        self._add_session_routes(app)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "areal"}],
            }

        return app

    def _route(self, api: str, by_path: bool) -> Callable[..., Awaitable[Response]]:
        if by_path:

            async def call_in(session: str, request: Request) -> Response:
                return await self._serve(api, request, session)

            return call_in

        async def call(request: Request) -> Response:
            return await self._serve(api, request, None)

        return call

    def _add_session_routes(self, app: FastAPI) -> None:
        book = self.book

        async def handle(request: Request, act: Callable[[KeyPolicy, dict[str, Any]], Any]) -> Response:
            try:
                key = self.keys.identify(request.headers.get("authorization"), request.headers.get("x-api-key"))
                body = parse_body(await request.body())
                if not isinstance(body, dict):
                    raise BodyError("expects a JSON object")
                return JSONResponse(act(key, body))
            except SessionError as e:
                return openai_error(e.status, str(e))
            except BodyError as e:
                return openai_error(400, str(e), e.field)

        @app.post("/rl/sessions")
        async def open_session(request: Request) -> Response:
            def act(key: KeyPolicy, body: dict[str, Any]) -> dict[str, Any]:
                session = book.open(body.get("task", ""), key.name, body.get("session_id"))
                base = f"{self.url}/s/{session.id}"
                return session.describe() | {"openai_base_url": f"{base}/v1", "anthropic_base_url": base}

            return await handle(request, act)

        @app.post("/rl/sessions/{sid}/end")
        async def end_session(sid: str, request: Request) -> Response:
            return await handle(request, lambda key, body: book.end(sid, key.name).describe())

        @app.post("/rl/sessions/{sid}/reward")
        async def reward(sid: str, request: Request) -> Response:
            def act(key: KeyPolicy, body: dict[str, Any]) -> dict[str, Any]:
                if "reward" not in body:
                    raise SessionError(400, "reward: the body needs 'reward' (a number)")
                return book.reward(sid, body["reward"], body.get("completion_id"), key.name).describe()

            return await handle(request, act)

        @app.get("/rl/sessions/{sid}")
        async def describe(sid: str, request: Request) -> Response:
            return await handle(request, lambda key, body: book.get(sid, key.name).describe())

        @app.get("/rl/stats")
        async def stats(request: Request) -> Response:
            return await handle(request, lambda key, body: self.stats())

    def stats(self) -> dict[str, Any]:
        """The session counts since start, and the sessions open or waiting for a reward now."""
        return asdict(self.book.counts) | {"open_sessions": len(self.book.sessions), "time": time.time()}
