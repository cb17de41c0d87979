"""serve-model's FastAPI app (`build_app`): SGLang's native routes, added group by group onto one
`ModelServer` (generation, pause and abort; weights, LoRA adapters and versions; info, health and cache),
behind `ClientGuard` (the admin key on control routes, the body size cap)."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.model_server.guard import ClientGuard, is_admin, unless_gone
from areal_agents.engines.model_server.openai_routes import add_openai_routes
from areal_agents.engines.model_server.server import ModelServer, ModelServerConfig, error_response
from areal_agents.engines.sglang.protocol import ProtocolError

CLOSE_TIMEOUT_S = 2.0  # on shutdown, the decode thread gets this long to leave its step (a stuck one is abandoned)


def build_app(engine: HFEngine, tokenizer, cfg: ModelServerConfig) -> FastAPI:
    """The app serving ``engine`` (closed when the app shuts down); its `ModelServer` is ``app.state.server``."""
    server = ModelServer(engine, tokenizer, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.broadcast.close()  # weight groups' connections, before the process exits
        server.prep.shutdown(wait=False, cancel_futures=True)
        engine.close(timeout_s=CLOSE_TIMEOUT_S)  # a decode thread stuck in a step must not keep the process up

    app = FastAPI(title="areal-agents serve-model (SGLang native API)", lifespan=lifespan)

    @app.exception_handler(ProtocolError)
    async def bad_request(request: Request, exc: ProtocolError) -> JSONResponse:
        return error_response(400, str(exc))  # SGLang's shape: {"error": {"message": ...}}

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        return error_response(400, "the body nests too deeply for serve-model to read")

    app.add_middleware(ClientGuard, max_body_bytes=cfg.max_body_bytes, admin_key=cfg.admin_key)
    app.state.server = server
    add_generation_routes(app, server)
    add_weight_routes(app, server)
    add_info_routes(app, server)
    add_openai_routes(app, server)  # /v1/chat/completions, /v1/completions, /v1/models
    return app


async def json_body(server: ModelServer, request: Request, required: bool = False) -> Any:
    """The request's JSON body (``{}`` if empty and not ``required``); `ProtocolError` (a 400) if it is not
    JSON (`ModelServer.parse`)."""
    return await server.parse(await request.body(), required)


async def json_object(server: ModelServer, request: Request, required: bool = False) -> dict:
    """`json_body`, which must be an object (a 400 naming the route otherwise)."""
    body = await json_body(server, request, required)
    if not isinstance(body, dict):
        raise ProtocolError(f"{request.url.path}: the body must be a JSON object")
    return body


def add_generation_routes(app: FastAPI, server: ModelServer) -> None:
    """/generate, /pause_generation, /continue_generation, /abort_request."""
    engine = server.engine

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body = await json_body(server, request, required=True)
        return await unless_gone(request.receive, server.generate(body))  # a client gone: its requests end

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        mode = (await json_object(server, request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return error_response(400, f"mode must be 'abort', 'retract' or 'in_place', got {str(mode)[:60]!r}")
        # abort: in-flight requests return now with finish_reason abort and their tokens so far
        await server.pause(mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        await server.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await json_object(server, request)
        if body.get("abort_all"):  # everyone's requests: a control action
            if not is_admin(request.headers.get("authorization"), server.cfg.admin_key):
                return error_response(401, "abort_all is a control action: send the admin key (--admin-key)")
            await engine.abort()
        elif body.get("rid"):
            await engine.abort(str(body["rid"]))
        return Response(status_code=200)


def add_weight_routes(app: FastAPI, server: ModelServer) -> None:
    """/update_weights_from_disk, the broadcast's /init_weights_update_group, /update_weights_from_distributed
    and /destroy_weights_update_group, /load_lora_adapter, /unload_lora_adapter, /update_weight_version,
    /get_weight_version (and /weight_version)."""
    engine = server.engine

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = await json_object(server, request, required=True)
        return await server.update_from_disk(body)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        return await server.load_lora(await json_object(server, request, required=True))

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        return await server.unload_lora(await json_object(server, request, required=True))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> Response:
        return await server.broadcast.init_group(await json_object(server, request, required=True))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> Response:
        return await server.broadcast.update(await json_object(server, request, required=True))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> Response:
        return await server.broadcast.destroy(await json_object(server, request))

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        body = await json_object(server, request, required=True)
        if body.get("new_version") is None:
            return error_response(400, "update_weight_version: new_version is required")
        if body.get("abort_all_requests", True):
            await engine.abort()
        server.names[engine.get_version()] = str(body["new_version"])
        message = f"Weight version updated to {body['new_version']}"
        return JSONResponse({"success": True, "message": message, "new_version": str(body["new_version"])})

    def weight_version() -> JSONResponse:
        return JSONResponse({"weight_version": server.weight_version})

    app.get("/get_weight_version")(weight_version)
    app.get("/weight_version")(weight_version)


def add_info_routes(app: FastAPI, server: ModelServer) -> None:
    """/get_model_info (and /model_info), /health (and /health_generate), /flush_cache, /get_server_info,
    /metrics."""
    engine, cfg = server.engine, server.cfg

    def model_info() -> JSONResponse:
        return JSONResponse(
            {
                "model_path": server.model_path,
                "tokenizer_path": cfg.tokenizer_path or cfg.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": server.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    app.get("/get_model_info")(model_info)
    app.get("/model_info")(model_info)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return server.health()  # 503: decode loop failed, gone or stuck (restart it), or paused (leave it)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        engine.flush_cache()
        return PlainTextResponse("Cache flushed.\n")

    @app.get("/metrics")
    async def metrics() -> Response:  # SGLang's names (its native API is this server's): a run's timeline polls them
        running, pending = engine.num_running, engine.num_pending
        lines = [
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs {running}",
            "# TYPE sglang:num_queue_reqs gauge",
            f"sglang:num_queue_reqs {max(pending - running, 0)}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/get_server_info")
    async def server_info() -> Response:
        return JSONResponse(
            {
                "server": "areal-agents serve-model",
                "model_path": server.model_path,
                "weight_version": server.weight_version,
                "max_running_requests": cfg.engine.max_running_requests,
                "engine": engine.stats.__dict__,
            }
        )
