"""serve-model's OpenAI-compatible routes, as vLLM and SGLang serve them: ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models`` (non-streaming).

Chat messages and tools are rendered with the tokenizer's chat template (``chat_template_kwargs`` from the
body, e.g. Qwen3's ``enable_thinking``), generated through `ModelServer.generate` (the same path as
SGLang's ``/generate``: request checks, pausing, aborts), and the reply parsed by the `ReplyParser` of the
template (``reasoning_content``, ``tool_calls``; ``tool_parser`` / ``reasoning_parser`` of the server's
config override the choice). A request serve-model cannot honour is a 400 in OpenAI's error shape with
the field named in ``param``. A ``model`` naming a loaded LoRA adapter is served with it (vLLM's convention;
any other ``model``, the served model's id first, is the base model), and /v1/models lists the adapters;
``seed`` seeds each sample. A request asks for at most ``--max-n`` samples (``n``, times the prompts of
/v1/completions); a client that disconnects has its samples aborted.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from areal_agents.chat import ReplyParser
from areal_agents.chat.template_messages import template_message
from areal_agents.engines.hf.request_checks import MAX_TOP_K, SAMPLING_EPS, SEED_BOUND
from areal_agents.engines.model_server.guard import BodyError, unless_gone
from areal_agents.engines.model_server.openai_shapes import (
    Generated,
    OpenAIRequestError,
    chat_logprobs,
    finish_reason,
    generated,
    plain_messages,
    reply_message,
    stop_strings,
    usage,
)
from areal_agents.engines.model_server.server import ModelServer
from areal_agents.engines.sglang.protocol import ProtocolError
from areal_agents.errors import ArealAgentsError
from areal_agents.models.families import stop_token_ids

# Fields that change sampling, accepted only at their no-op value (OpenAI's defaults).
NO_OP_FIELDS: dict[str, Any] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "best_of": None,
    "suffix": None,
    "echo": False,
    "prediction": None,
    "audio": None,
    "modalities": None,
}
TEMPLATE_ARGS = ("messages", "conversation", "tools", "add_generation_prompt", "tokenize", "continue_final_message")


def openai_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class ServerFailure(Exception):
    """The engine could not serve the request (`ModelServer.generate` answered this status and message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Sampling:
    """The OpenAI sampling fields common to both routes, checked."""

    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None  # vLLM's: the i-th sample of a prompt samples from seed + i (SGLang's sampling_seed)


def read_sampling(body: dict[str, Any], max_tokens_default: int | None, max_n: int) -> Sampling:
    """`Sampling` from ``body`` (``n`` at most ``max_n``); `OpenAIRequestError` names a field of the wrong
    type, range or one whose value serve-model cannot honour."""
    for key, no_op in NO_OP_FIELDS.items():
        if body.get(key) not in (None, no_op, {}, []):
            raise OpenAIRequestError(key, f"{body[key]!r} is not supported by serve-model (leave it unset)")
    if body.get("stream"):
        raise OpenAIRequestError("stream", "serve-model answers whole completions only (stream=false)")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    s = Sampling(
        n=_number(body, "n", int, 1, low=1, high=max_n),
        max_tokens=_number(body, key, int, max_tokens_default, low=1) if max_tokens is not None else max_tokens_default,
        temperature=_number(body, "temperature", float, 1.0, low=0.0),
        top_p=_number(body, "top_p", float, 1.0, low=0.0, high=1.0),
        top_k=_number(body, "top_k", int, -1, low=-1, high=MAX_TOP_K),
        stop=stop_strings(body.get("stop")),
        seed=_number(body, "seed", int, None, low=-SEED_BOUND, high=SEED_BOUND - 1),
    )
    if s.top_p < SAMPLING_EPS:
        raise OpenAIRequestError("top_p", f"expects a number in [{SAMPLING_EPS}, 1], got {s.top_p}")
    if 0 < s.temperature < SAMPLING_EPS:
        raise OpenAIRequestError("temperature", f"expects 0 (greedy) or at least {SAMPLING_EPS}, got {s.temperature}")
    if s.seed is not None and s.seed + s.n > SEED_BOUND:  # the i-th sample's seed is seed + i
        raise OpenAIRequestError("seed", f"expects seed + n <= 2**63, got {s.seed} + {s.n}")
    return s


def _number(
    body: dict[str, Any], key: str, kind: type, default: Any, low: float | None = None, high: float | None = None
) -> Any:
    """``body[key]`` as ``kind`` (int: a whole number), finite and within [low, high]; ``default`` if unset."""
    value = body.get(key)
    if value is None:
        return default
    what = "an integer" if kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OpenAIRequestError(key, f"expects {what}, got {_short(value)}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():  # NaN and the infinities included
            raise OpenAIRequestError(key, f"expects a whole finite number, got {value}")
        number = int(value)
    else:
        try:
            number = float(value)
        except OverflowError:  # an int past any float
            number = math.inf
        if not math.isfinite(number):
            raise OpenAIRequestError(key, f"expects a finite number, got {_short(value)}")
    if (low is not None and number < low) or (high is not None and number > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise OpenAIRequestError(key, f"expects a value {bounds}, got {_short(value)}")
    return number


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def chat_parser(server: ModelServer) -> ReplyParser:
    """The reply parser of the served tokenizer's template (``--tool-parser`` / ``--reasoning-parser``, the
    config's ``tool_parser`` / ``reasoning_parser``, override the detected ones)."""
    template = getattr(server.tokenizer, "chat_template", None)
    return ReplyParser.for_template(template, server.cfg.tool_parser, server.cfg.reasoning_parser)


@dataclass
class OpenAIServing:
    """What the /v1 routes hold: the server, its reply parser and its stop tokens."""

    server: ModelServer
    parser: ReplyParser
    stop_ids: set[int]


def adapter_of(server: ModelServer, body: dict[str, Any]) -> str | None:
    """The LoRA adapter a /v1 request names as its ``model`` (vLLM's convention); None: the base model (the
    served model's id always names it, whatever adapter might be loaded under it)."""
    model = body.get("model")
    if not isinstance(model, str) or model in server.served_ids():
        return None
    return model if model in server.engine.lora_adapters() else None


async def run_engine(
    server: ModelServer, prompts: list[list[int]], s: Sampling, stop_ids: set[int], lora: str | None = None
) -> list[tuple[list[int], list[float], str]]:
    """Generate ``s.n`` samples of each prompt through `ModelServer.generate` (SGLang's /generate path), with
    LoRA adapter ``lora`` (None: the base model): (tokens, logprobs, finish) per sample, the samples of a
    prompt together. `ServerFailure` if it failed."""
    params = {
        "max_new_tokens": s.max_tokens or server.engine.limits.context or 4096,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "stop_token_ids": sorted(stop_ids),
    }
    ids = [p for p in prompts for _ in range(s.n)]
    body = {"input_ids": ids, "sampling_params": params, "return_logprob": True, "rid": [uuid.uuid4().hex for _ in ids]}
    if s.seed is not None:
        body["sampling_params"] = [{**params, "sampling_seed": s.seed + k} for _ in prompts for k in range(s.n)]
    if lora is not None:
        body["lora_path"] = lora
    reply = await server.generate(body)
    out = json.loads(reply.body)
    if reply.status_code != 200:
        raise ServerFailure(reply.status_code, out.get("error", {}).get("message", str(out)))
    return [
        (
            [int(t[1]) for t in r["meta_info"]["output_token_logprobs"]],
            [float(t[0]) for t in r["meta_info"]["output_token_logprobs"]],
            r["meta_info"]["finish_reason"]["type"],
        )
        for r in out
    ]


def render_chat(server: ModelServer, body: dict[str, Any]) -> tuple[list[int], list[dict] | None]:
    """The prompt tokens of a chat request (its messages and tools through the chat template) and its tools."""
    template = server.tokenizer.chat_template
    messages = [
        m if m["role"] != "assistant" else template_message(template, m) for m in plain_messages(body.get("messages"))
    ]
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise OpenAIRequestError("tools", "expects a list of tool objects ({'type': 'function', 'function': ...})")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or any(k in TEMPLATE_ARGS for k in kwargs):
        raise OpenAIRequestError("chat_template_kwargs", f"expects an object of template variables but {TEMPLATE_ARGS}")
    try:
        text = server.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as e:  # noqa: BLE001  (the template's own raise_exception, or a message it cannot render)
        raise OpenAIRequestError("messages", f"the chat template cannot render them: {e}") from e
    try:
        return server.tokenize(text), tools
    except ProtocolError as e:  # too long for the context
        raise OpenAIRequestError("messages", str(e).split(": ", 1)[-1]) from None


def tool_choice_on(body: dict[str, Any], tools: list[dict] | None) -> bool:
    """Whether replies are parsed for tool calls: tools given and ``tool_choice`` not ``none``."""
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        message = f"serve-model does not force calls: 'auto' or 'none', got {_short(choice)}"
        raise OpenAIRequestError("tool_choice", message)
    return bool(tools) and choice != "none"


async def chat_completion(serving: OpenAIServing, body: dict[str, Any]) -> dict[str, Any]:
    """The ``chat.completion`` object answering ``body``."""
    server = serving.server
    if not isinstance(body, dict):
        raise OpenAIRequestError(None, "the body must be a JSON object")
    s = read_sampling(body, None, server.cfg.max_n)
    want_logprobs = body.get("logprobs") or False
    if not isinstance(want_logprobs, bool):
        raise OpenAIRequestError("logprobs", f"expects true or false, got {_short(want_logprobs)}")
    if _number(body, "top_logprobs", int, 0, low=0) > 0:
        raise OpenAIRequestError("top_logprobs", "the engine gives the chosen tokens' logprobs only: use 0")
    prompt, tools = await server.prepare(lambda: render_chat(server, body))  # template and tokenizer: off the loop
    parse_tools = tool_choice_on(body, tools)
    parser, stop_ids = serving.parser, serving.stop_ids
    choices, n_out = [], 0
    samples = await run_engine(server, [prompt], s, stop_ids, adapter_of(server, body))
    for i, (tokens, logprobs, reason) in enumerate(samples):
        gen = generated(server.tokenizer, tokens, logprobs, reason, s.stop, stop_ids)
        message, errors = reply_message(parser, gen.text, parse_tools)
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "logprobs": chat_logprobs(server.tokenizer, gen.tokens, gen.logprobs) if want_logprobs else None,
            "finish_reason": finish_reason(message, gen.finish),
        }
        if errors:
            choice["tool_call_errors"] = errors  # non-standard: the malformed calls, which stay in content
        choices.append(choice)
        n_out += len(gen.tokens)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(body.get("model") or server.model_path),
        "choices": choices,
        "usage": usage(len(prompt), n_out),
        "system_fingerprint": server.weight_version,
    }


def completion_prompts(server: ModelServer, prompt: Any, n: int = 1) -> list[list[int]]:
    """``prompt`` of /v1/completions: a string, a list of strings, token ids, or a list of token id lists; with
    ``n`` samples each, at most ``--max-n`` samples in all (counted before any prompt is tokenized)."""
    if isinstance(prompt, str):
        return [_tokenized(server, prompt, "prompt")]
    if isinstance(prompt, list) and prompt:
        count = len(prompt) if isinstance(prompt[0], (str, list)) else 1
        if count * n > server.cfg.max_n:
            raise OpenAIRequestError(
                "n",
                f"{count} prompts x n={n} asks for {count * n} samples; this server takes at most "
                f"{server.cfg.max_n} in one request (--max-n)",
            )
        if all(isinstance(p, str) for p in prompt):
            return [_tokenized(server, p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise OpenAIRequestError("prompt", "expects a string, a list of strings, token ids or a list of token id lists")


def _tokenized(server: ModelServer, text: str, field: str) -> list[int]:
    try:
        return server.tokenize(text, field)
    except ProtocolError as e:  # too long for the context
        raise OpenAIRequestError(field, str(e).split(": ", 1)[-1]) from None


async def text_completion(serving: OpenAIServing, body: dict[str, Any]) -> dict[str, Any]:
    """The ``text_completion`` object answering ``body``: ``s.n`` choices per prompt, prompt by prompt."""
    server = serving.server
    if not isinstance(body, dict):
        raise OpenAIRequestError(None, "the body must be a JSON object")
    s = read_sampling(body, 16, server.cfg.max_n)  # 16: OpenAI's default max_tokens for completions
    top = body.get("logprobs")
    if top is not None and _number(body, "logprobs", int, 0, low=0) > 0:
        raise OpenAIRequestError("logprobs", "the engine gives the chosen tokens' logprobs only: use 0")
    prompts = await server.prepare(lambda: completion_prompts(server, body.get("prompt"), s.n))
    stop_ids = serving.stop_ids
    samples = await run_engine(server, prompts, s, stop_ids, adapter_of(server, body))
    choices, n_out = [], 0
    for i, (tokens, logprobs, reason) in enumerate(samples):
        gen = generated(server.tokenizer, tokens, logprobs, reason, s.stop, stop_ids)
        ended = gen.tokens and gen.tokens[-1] in stop_ids
        text = server.tokenizer.decode(gen.tokens[:-1] if ended else gen.tokens, skip_special_tokens=True)
        if s.stop:  # a stop string ends the text (special tokens left out, as the reply shows it)
            text = text[: min((k for k in (text.find(x) for x in s.stop) if k >= 0), default=len(text))]
        choices.append(
            {
                "index": i,
                "text": text,
                "logprobs": _completion_logprobs(server.tokenizer, gen) if top is not None else None,
                "finish_reason": gen.finish,
            }
        )
        n_out += len(gen.tokens)
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:24]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": str(body.get("model") or server.model_path),
        "choices": choices,
        "usage": usage(sum(len(p) for p in prompts), n_out),
        "system_fingerprint": server.weight_version,
    }


def _completion_logprobs(tokenizer, gen: Generated) -> dict[str, Any]:
    """The legacy completions ``logprobs``: tokens, their logprobs and text offsets (no alternatives)."""
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in gen.tokens]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {"tokens": pieces, "token_logprobs": list(gen.logprobs), "top_logprobs": None, "text_offset": offsets}


def add_openai_routes(app: FastAPI, server: ModelServer) -> None:
    """/v1/chat/completions, /v1/completions, /v1/models on ``app``."""
    try:
        serving = OpenAIServing(server, chat_parser(server), set(stop_token_ids(server.tokenizer)))
    except ArealAgentsError as e:  # an unknown parser name: a start-up error naming the field
        raise ArealAgentsError(f"serve-model: {e}") from e

    async def answer(request: Request, make, prompt_field: str) -> Response:
        try:
            body = await server.parse(await request.body(), required=True)
        except BodyError as e:
            return openai_error(400, str(e), e.field)
        return await unless_gone(request.receive, respond(make, body, prompt_field))  # a client gone: aborted

    async def respond(make, body: Any, prompt_field: str) -> Response:
        try:
            return JSONResponse(await make(serving, body))
        except OpenAIRequestError as e:
            return openai_error(400, str(e), e.param)
        except ServerFailure as e:  # a prompt past the context is named by its token ids: name the request's field
            message = str(e)
            if e.status == 400 and message.startswith("input_ids"):
                return openai_error(400, f"{prompt_field}: {message.split(': ', 1)[-1]}", prompt_field)
            return openai_error(e.status, message)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await answer(request, chat_completion, "messages")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, text_completion, "prompt")

    @app.get("/v1/models")
    async def models() -> Response:
        model = {"id": server.model_path, "object": "model", "created": 0, "owned_by": "areal-agents"}
        adapters = [  # as vLLM lists LoRA adapters: by name, with the base model as their parent
            {**model, "id": name, "root": server.lora_paths.get(name, name), "parent": server.model_path}
            for name in server.engine.lora_adapters()
        ]
        return JSONResponse({"object": "list", "data": [model, *adapters]})
