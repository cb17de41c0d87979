"""`areal-agents serve-model`: `HFEngine` behind SGLang's native HTTP API, a CPU drop-in for sglang.launch_server.

    areal-agents serve-model --model-path runs/tiny --port 30000      # like python -m sglang.launch_server

Endpoints (SGLang 0.5.x shapes, see docs/serve-model.md): /generate, /pause_generation,
/continue_generation, /abort_request, /update_weights_from_disk, /update_weight_version,
/get_model_info (and /model_info), /get_weight_version (and /weight_version), /health,
/health_generate, /flush_cache, /get_server_info.

A request the model cannot take (a token id outside the vocabulary, a prompt past its context) is a 400
naming the field, and ``max_new_tokens`` is capped at the context left; an error inside one request fails
that request (500) and the others go on. If the engine's decode loop itself fails, /health and
/health_generate answer 503 (the launcher restarts the server). SIGTERM stops the server within
`EXIT_DEADLINE_S` seconds, whatever its decode thread is doing.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.hf.request_checks import RequestError, check_request
from areal_agents.engines.sglang.protocol import ProtocolError, generate_response, parse_generate
from areal_agents.errors import EngineError
from areal_agents.types import GenRequest

SHUTDOWN_GRACE_S = 2.0  # on SIGTERM, requests in flight get this long to finish, then are cancelled
CLOSE_TIMEOUT_S = 2.0  # ... and the decode thread this long to leave its step (a stuck one is abandoned)
EXIT_DEADLINE_S = 8.0  # ... and if the process is still there after this long, it exits anyway


@dataclass
class ModelServerConfig:
    model_path: str
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    weight_version: str = "default"
    dtype: str = "float32"
    max_running_requests: int = 256
    prefix_cache_tokens: int = 65536
    stale_kv: str = "recompute"
    kv_dtype: str = "auto"  # the KV cache's dtype (auto: the model's)
    fast_decode: bool = True  # Llama-family models decode with the engine's own step (`LlamaDecodeStep`)
    cpu_threads: int = 0  # the decode thread's intra-op threads (0: torch's default, all cores)
    seed: int = 0


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


class ModelServer:
    """The app's state: the engine, the tokenizer, and the weight_version names of engine versions."""

    def __init__(self, engine: HFEngine, tokenizer, cfg: ModelServerConfig) -> None:
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.names: dict[int, str] = {engine.get_version(): cfg.weight_version}
        self.model_path = cfg.model_path
        self.update_lock = asyncio.Lock()
        # the most characters one token stands for: a text longer than context x this cannot fit, and is
        # refused before tokenizing it (megabytes of text would hold the event loop for seconds)
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1

    @property
    def weight_version(self) -> str:
        return self.version_name(None)

    def version_name(self, version: int | None) -> str:
        version = self.engine.get_version() if version is None else version
        return self.names.get(version, str(version))

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def tokenize(self, text: str) -> list[int]:
        context = self.engine.limits.context
        if context and len(text) > context * self.max_token_chars:
            raise ProtocolError(f"text: {len(text)} characters cannot fit the model's context of {context} tokens")
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def generate(self, body: Any) -> Response:
        try:
            requests = self.checked(body, parse_generate(body, self.tokenize))
        except (ProtocolError, RequestError) as e:
            return _error(400, str(e))
        replies = await asyncio.gather(*(self.engine.generate_once(r) for r, _ in requests), return_exceptions=True)
        failed = next((r for r in replies if isinstance(r, BaseException)), None)
        if failed is not None:
            return self.failure(failed)
        out = [
            generate_response(r, resp, options, version_name=self.version_name, decode=self.decode)
            for (r, options), resp in zip(requests, replies)
        ]
        return JSONResponse(out if requests[0][1]["batch"] else out[0])

    def failure(self, error: BaseException) -> JSONResponse:
        """A failed /generate: 400 for the request's fault, 503 when the engine cannot serve (its decode loop
        failed: the launcher restarts the server, the client retries), else 500 for this request alone."""
        if isinstance(error, RequestError):
            return _error(400, str(error))
        unhealthy = self.engine.health()
        if unhealthy is not None:
            return _error(503, unhealthy)
        if not isinstance(error, EngineError):
            raise error
        return _error(500, str(error))

    def checked(self, body: dict, requests: list[tuple[GenRequest, dict]]) -> list[tuple[GenRequest, dict]]:
        """The requests with ``max_new_tokens`` capped at the context left; `RequestError` names the field
        (``input_ids[1][7]``, ``text``, ``sampling_params.top_p``) of one the model cannot take."""
        batch = requests[0][1]["batch"]
        key = "input_ids" if body.get("input_ids") is not None else "text"
        params_list = isinstance(body.get("sampling_params"), list)
        out = []
        for i, (request, options) in enumerate(requests):
            fields = {"ids_field": f"{key}[{i}]" if batch else key, "params_field": "sampling_params"}
            if params_list:
                fields["params_field"] = f"sampling_params[{i}]"
            out.append((check_request(request, self.engine.limits, **fields), options))
        return out

    async def update_from_disk(self, body: dict) -> JSONResponse:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return _error(400, "update_weights_from_disk: model_path (a directory) is required")
        async with self.update_lock:
            if body.get("abort_all_requests"):
                await self.engine.abort()
            version = self.engine.get_version() + 1
            try:
                await self.engine.update_weights_from_disk(path, version=version)
            except Exception as e:  # noqa: BLE001  (SGLang replies success=false, 400)
                return JSONResponse({"success": False, "message": f"Failed to update weights: {e}"}, 400)
            message = "Succeeded to update model weights."
            if body.get("weight_version") is not None:
                self.names[version] = str(body["weight_version"])
                message += f" Weight version updated to {body['weight_version']}."
            else:
                self.names[version] = self.names.get(version - 1, str(version - 1))  # SGLang keeps the name
            self.model_path = path
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})


def build_app(engine: HFEngine, tokenizer, cfg: ModelServerConfig) -> FastAPI:
    server = ModelServer(engine, tokenizer, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.close(timeout_s=CLOSE_TIMEOUT_S)  # a decode thread stuck in a step must not keep the process up

    app = FastAPI(title="areal-agents serve-model (SGLang native API)", lifespan=lifespan)

    @app.exception_handler(ProtocolError)
    async def bad_request(request: Request, exc: ProtocolError) -> JSONResponse:
        return _error(400, str(exc))  # SGLang's shape: {"error": {"message": ...}}

    app.state.server = server

    async def json_body(request: Request, required: bool = False) -> dict:
        raw = await request.body()
        if not raw.strip():
            if required:
                raise ProtocolError("a JSON body is required")
            return {}
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ProtocolError(f"the body is not valid JSON: {e}") from e
        return body

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body = await json_body(request, required=True)
        return await server.generate(body)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        mode = (await json_body(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _error(400, f"mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        await engine.pause()
        if mode == "abort":  # in-flight requests return now with finish_reason abort and their tokens so far
            await engine.abort()
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        await engine.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await json_body(request)
        if body.get("abort_all"):
            await engine.abort()
        elif body.get("rid"):
            await engine.abort(str(body["rid"]))
        return Response(status_code=200)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = await json_body(request, required=True)
        return await server.update_from_disk(body)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        body = await json_body(request, required=True)
        if body.get("new_version") is None:
            return _error(400, "update_weight_version: new_version is required")
        if body.get("abort_all_requests", True):
            await engine.abort()
        server.names[engine.get_version()] = str(body["new_version"])
        message = f"Weight version updated to {body['new_version']}"
        return JSONResponse({"success": True, "message": message, "new_version": str(body["new_version"])})

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

    def weight_version() -> JSONResponse:
        return JSONResponse({"weight_version": server.weight_version})

    app.get("/get_weight_version")(weight_version)
    app.get("/weight_version")(weight_version)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        unhealthy = engine.health()  # decode loop failed, gone or stuck: 503, so launchers restart the server
        return Response(status_code=200) if unhealthy is None else _error(503, unhealthy)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        engine.flush_cache()
        return PlainTextResponse("Cache flushed.\n")

    @app.get("/get_server_info")
    async def server_info() -> Response:
        return JSONResponse(
            {
                "server": "areal-agents serve-model",
                "model_path": server.model_path,
                "weight_version": server.weight_version,
                "max_running_requests": cfg.max_running_requests,
                "engine": engine.stats.__dict__,
            }
        )

    return app


def serve_model(cfg: ModelServerConfig) -> None:
    """Load the model and serve it until interrupted (the `serve-model` command)."""
    import uvicorn  # noqa: PLC0415

    from areal_agents.models import load_model, load_tokenizer  # noqa: PLC0415

    model = load_model(cfg.model_path, cfg.dtype)
    tokenizer = load_tokenizer(cfg.tokenizer_path or cfg.model_path)
    engine = HFEngine(
        model,
        max_batch_size=cfg.max_running_requests,
        seed=cfg.seed,
        prefix_cache_tokens=cfg.prefix_cache_tokens,
        stale_kv=cfg.stale_kv,
        kv_dtype=cfg.kv_dtype,
        fast_decode=cfg.fast_decode,
        num_threads=cfg.cpu_threads or None,
    )
    app = build_app(engine, tokenizer, cfg)
    print(f"serve-model: {cfg.model_path} on http://{cfg.host}:{cfg.port} (SGLang native API)", flush=True)
    config = uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE_S
    )
    server = _deadline_server(uvicorn.Server)(config)
    server.run()
    if not server.started:
        sys.exit(3)  # uvicorn.run's exit code when the server could not start (e.g. the port is taken)


def _deadline_server(base: type) -> type:
    """``base`` (uvicorn's `Server`), which exits the process `EXIT_DEADLINE_S` after the first SIGTERM or
    SIGINT if the graceful shutdown has not ended it by then (e.g. a request stuck in a hung engine)."""

    class DeadlineServer(base):
        _deadline: threading.Timer | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            if self._deadline is None:
                self._deadline = threading.Timer(EXIT_DEADLINE_S, _exit_now, (128 + int(sig),))
                self._deadline.daemon = True
                self._deadline.start()

    return DeadlineServer


def _exit_now(code: int) -> None:
    print(f"serve-model: still running {EXIT_DEADLINE_S:.0f}s after the signal to stop; exiting", file=sys.stderr)
    sys.stderr.flush()
    os._exit(code)
