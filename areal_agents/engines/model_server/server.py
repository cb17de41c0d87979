"""`ModelServer`: serve-model's state (the engine, the tokenizer, the weight_version names of engine versions,
whether a client paused it) and the work behind /generate, /update_weights_from_disk and SGLang's
/load_lora_adapter and /unload_lora_adapter (the broadcast routes: ``broadcast.py``);
`ModelServerConfig`: its command line, limits included (checked when made: a bad parser name or limit fails
before the model loads). Request bodies are parsed, checked and tokenized on one thread of their own
(`ModelServer.prepare`), so a large one never holds the event loop (/health answers meanwhile)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi.responses import JSONResponse, Response

from areal_agents.chat import REASONING_PARSERS, TOOL_PARSERS
from areal_agents.config import EngineOptions
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.hf.request_checks import RequestError, check_request
from areal_agents.engines.model_server.adapters import AdapterRefused, check_adapter_load
from areal_agents.engines.model_server.broadcast import BroadcastReceiver
from areal_agents.engines.model_server.guard import MAX_JSON_VALUES, parse_body
from areal_agents.engines.server_control import paused_body
from areal_agents.engines.sglang.protocol import ProtocolError, generate_response, parse_generate
from areal_agents.errors import ArealAgentsError, EngineError, did_you_mean
from areal_agents.types import GenRequest

T = TypeVar("T")
SMALL_BODY = 64 << 10  # bodies up to this are parsed on the event loop (well under a millisecond)
# limits: positive ints, checked at start-up
LIMITS = ("max_n", "max_body_bytes", "max_json_values", "max_lora_rank", "max_loras")


@dataclass
class ModelServerConfig:
    model_path: str
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    weight_version: str = "default"
    dtype: str = "float32"
    engine: EngineOptions = field(default_factory=EngineOptions)  # how the engine batches and decodes
    seed: int = 0
    tool_parser: str = "auto"  # how /v1/chat/completions reads tool calls (auto: from the chat template)
    reasoning_parser: str = "auto"  # how it reads reasoning (auto: from the chat template)
    max_n: int = 256  # samples one request asks for: /v1's n (x prompts), the prompts of a /generate batch
    max_body_bytes: int = 16 << 20  # a larger request body is refused (413) while it is read
    max_json_values: int = MAX_JSON_VALUES  # ... and one holding more JSON values than this (400), before parsing
    admin_key: str | None = None  # set: the control routes want it ('Authorization: Bearer KEY'), else 401
    max_lora_rank: int = 64  # /load_lora_adapter refuses adapters of a larger rank
    max_loras: int = 8  # ... and a new one while this many are loaded

    def __post_init__(self) -> None:
        for key in LIMITS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArealAgentsError(f"{key} (--{key.replace('_', '-')}): expects an integer >= 1, got {value!r}")
        for key, known in (("tool_parser", TOOL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            value, choices = getattr(self, key), ["auto", *known]
            if value not in choices:
                hint = did_you_mean(str(value), choices)
                flag = "--" + key.replace("_", "-")
                raise ArealAgentsError(f"{key} ({flag}): expects one of {', '.join(choices)}, got {value!r}.{hint}")


def error_response(status: int, message: str) -> JSONResponse:
    """SGLang's error shape: ``{"error": {"message": ...}}``."""
    return JSONResponse({"error": {"message": message}}, status_code=status)


class ModelServer:
    """The app's state: the engine, the tokenizer, and the weight_version names of engine versions."""

    def __init__(self, engine: HFEngine, tokenizer, cfg: ModelServerConfig) -> None:
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.names: dict[int, str] = {engine.get_version(): cfg.weight_version}
        self.model_path = cfg.model_path
        self.lora_paths: dict[str, str] = {}  # the LoRA adapters loaded over HTTP: name -> path
        self.update_lock = asyncio.Lock()
        self.paused_at: float | None = None  # time.monotonic() of /pause_generation, until /continue_generation
        self.pause_mode: str | None = None  # ... and its mode: abort, retract or in_place
        self.prep = ThreadPoolExecutor(1, thread_name_prefix="serve-model-prep")  # parse, check, tokenize
        # /init_weights_update_group, /update_weights_from_distributed
        self.broadcast = BroadcastReceiver(engine, self.update_lock, self.name_new_version, self.flush_refused)
        # the most characters one token stands for: a text longer than context x this cannot fit, and is
        # refused before tokenizing it (megabytes of text would hold the event loop for seconds)
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1

    @property
    def weight_version(self) -> str:
        return self.version_name(None)

    def version_name(self, version: int | None) -> str:
        version = self.engine.get_version() if version is None else version
        return self.names.get(version, str(version))

    def health(self) -> Response:
        """/health's reply: 503 with the reason when the engine cannot serve (the supervisor restarts it), 503
        saying ``paused`` while a client has paused generation (alive: left alone), else 200."""
        unhealthy = self.engine.health()
        if unhealthy is not None:
            return error_response(503, unhealthy)
        if self.paused_at is not None:
            return JSONResponse(paused_body(time.monotonic() - self.paused_at), status_code=503)
        return Response(status_code=200)

    async def pause(self, mode: str) -> None:
        """/pause_generation: stop at a step boundary (``abort``: running requests return now, as abort;
        ``in_place`` and ``retract``: they wait, and go on at /continue_generation)."""
        if self.paused_at is None:
            self.paused_at = time.monotonic()
        self.pause_mode = mode
        await self.engine.pause()
        if mode == "abort":
            await self.engine.abort()

    async def resume(self) -> None:
        """/continue_generation."""
        await self.engine.resume()
        self.paused_at = self.pause_mode = None

    def flush_refused(self, route: str, body: dict) -> JSONResponse | None:
        """The 400 SGLang's failure becomes when weights come with ``flush_cache`` (its default) while an
        ``in_place`` pause keeps requests: SGLang loads them, then its cache flush fails on the pending
        requests and the scheduler asserts (the server dies). Here nothing is loaded; None: go ahead.
        serve-model itself needs no flush: new weights drop its prefix cache (`HFEngine.update_weights`)."""
        pending = self.engine.num_pending
        if not body.get("flush_cache", True) or self.pause_mode != "in_place" or not pending:
            return None
        message = (
            f"{route}: flush_cache is true, but an in_place pause keeps {pending} requests and the cache cannot be "
            "flushed while requests are pending (SGLang's flush fails and its scheduler asserts); send "
            "flush_cache: false (the kept requests go on with the KV cache they have), or pause with mode abort; "
            "nothing was loaded"
        )
        return JSONResponse({"success": False, "message": message}, status_code=400)

    def served_ids(self) -> set[str]:
        """The ids a client names the base model by (/v1/models: the model path, the launch's and the current)."""
        return {self.cfg.model_path, self.model_path}

    async def parse(self, raw: bytes, required: bool = False) -> Any:
        """The JSON of a request body (`parse_body`: a `BodyError` names what is wrong); a large one is parsed
        on the preparing thread."""
        if len(raw) <= SMALL_BODY:
            return parse_body(raw, required, self.cfg.max_json_values)
        return await self.prepare(lambda: parse_body(raw, required, self.cfg.max_json_values))

    async def prepare(self, work: Callable[[], T]) -> T:
        """``work()`` (parse, check, tokenize a request) on the server's preparing thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, work)

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def tokenize(self, text: str, field: str = "text") -> list[int]:
        """``text``'s token ids; `ProtocolError` naming ``field`` for a text too long to fit the context."""
        context = self.engine.limits.context
        if context and len(text) > context * self.max_token_chars:
            raise ProtocolError(f"{field}: {len(text)} characters cannot fit the model's context of {context} tokens")
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def generate(self, body: Any) -> Response:
        try:
            requests = await self.prepare(
                lambda: self.checked(body, parse_generate(body, self.tokenize, self.cfg.max_n))
            )
        except (ProtocolError, RequestError) as e:
            return error_response(400, str(e))
        replies = await asyncio.gather(
            *(self.engine.generate_once(r, checked=True) for r, _ in requests), return_exceptions=True
        )
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
            return error_response(400, str(error))
        unhealthy = self.engine.health()
        if unhealthy is not None:
            return error_response(503, unhealthy)
        if not isinstance(error, EngineError):
            raise error
        return error_response(500, str(error))

    def checked(self, body: dict, requests: list[tuple[GenRequest, dict]]) -> list[tuple[GenRequest, dict]]:
        """The requests with ``max_new_tokens`` capped at the context left; `RequestError` names the field
        (``input_ids[1][7]``, ``text``, ``sampling_params.top_p``) of one the model cannot take."""
        batch = requests[0][1]["batch"]
        key = "input_ids" if body.get("input_ids") is not None else "text"
        params_list = isinstance(body.get("sampling_params"), list)
        lora_list = isinstance(body.get("lora_path"), list)
        adapters = self.engine.lora_adapters()
        out = []
        for i, (request, options) in enumerate(requests):
            fields = {"ids_field": f"{key}[{i}]" if batch else key, "params_field": "sampling_params"}
            if params_list:
                fields["params_field"] = f"sampling_params[{i}]"
            fields["lora_field"] = f"lora_path[{i}]" if lora_list else "lora_path"
            out.append((check_request(request, self.engine.limits, adapters=adapters, **fields), options))
        return out

    async def load_lora(self, body: Any) -> JSONResponse:
        """SGLang's /load_lora_adapter: ``{"lora_name", "lora_path"}`` (``pinned``, ``lora_id`` ignored). An
        adapter of the same name is replaced (SGLang refuses that: unload first), so a trainer's adapter-only
        weight sync is one call: the engine's version moves on, named as the previous one until
        /update_weight_version names it. Replies ``{"success", "error_message", "loaded_adapters"}``, 400 on failure."""
        name, path = (body.get(k) if isinstance(body, dict) else None for k in ("lora_name", "lora_path"))
        async with self.update_lock:
            cfg = self.cfg
            try:
                limits = {"max_rank": cfg.max_lora_rank, "max_loras": cfg.max_loras}
                loaded = self.engine.lora_adapters()
                await self.prepare(
                    lambda: check_adapter_load(name, path, served=self.served_ids(), loaded=loaded, **limits)
                )
            except AdapterRefused as e:
                return self.lora_result(False, f"Failed to load LoRA adapter {str(name)[:80]!r}: {e}")
            version = self.engine.get_version() + 1
            try:
                await self.engine.load_lora_adapter(name, path, version=version)
            except Exception as e:  # noqa: BLE001  (SGLang replies success=false, 400)
                # the engine's reason may quote the adapter's files: the server's log has it, the client not
                print(f"serve-model: load_lora_adapter {name!r} from {path}: {e}", file=sys.stderr, flush=True)
                return self.lora_result(
                    False,
                    f"Failed to load LoRA adapter {name!r}: {path} is not an adapter this model can serve "
                    "(modules, shapes or options it does not take; the server's log says which)",
                )
            self.name_new_version(version, None)
            self.lora_paths[name] = path
        return self.lora_result(True)

    async def unload_lora(self, body: Any) -> JSONResponse:
        """SGLang's /unload_lora_adapter: ``{"lora_name"}``; requests running with it fail."""
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or name not in self.engine.lora_adapters():
            loaded = ", ".join(self.engine.lora_adapters()) or "none"
            return self.lora_result(
                False, f"unload_lora_adapter: LoRA adapter {name!r} is not loaded (loaded: {loaded})"
            )
        async with self.update_lock:
            await self.engine.unload_lora_adapter(name)
            self.lora_paths.pop(name, None)
        return self.lora_result(True)

    def lora_result(self, success: bool, message: str = "") -> JSONResponse:
        """SGLang's LoRAUpdateOutput: success, error_message and the loaded adapters (name -> path)."""
        loaded = {name: self.lora_paths.get(name, name) for name in self.engine.lora_adapters()}
        reply = {"success": success, "error_message": message, "loaded_adapters": loaded}
        return JSONResponse(reply, status_code=200 if success else 400)

    async def update_from_disk(self, body: dict) -> JSONResponse:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return error_response(400, "update_weights_from_disk: model_path (a directory) is required")
        async with self.update_lock:
            if body.get("abort_all_requests"):
                await self.engine.abort()
            refused = self.flush_refused("update_weights_from_disk", body)
            if refused is not None:
                return refused
            version = self.engine.get_version() + 1
            try:
                await self.engine.update_weights_from_disk(path, version=version)
            except Exception as e:  # noqa: BLE001  (SGLang replies success=false, 400)
                return JSONResponse({"success": False, "message": f"Failed to update weights: {e}"}, 400)
            message = "Succeeded to update model weights."
            if body.get("weight_version") is not None:
                message += f" Weight version updated to {body['weight_version']}."
            self.name_new_version(version, body.get("weight_version"))
            self.model_path = path
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    def name_new_version(self, version: int, name: Any) -> None:
        """Name the engine's new ``version`` ``name`` (None: the previous version's name, as SGLang keeps it)."""
        self.names[version] = str(name) if name is not None else self.names.get(version - 1, str(version - 1))
