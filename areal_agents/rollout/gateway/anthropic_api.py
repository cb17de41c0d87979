"""Anthropic's Messages API (``POST /v1/messages``) over `ChatCapture.create`: a request body as chat kwargs,
the `ChatCompletion` back as a ``Message``, and Anthropic's error body.

Sampling comes from the rollout config, as in `ChatCapture`: ``temperature``, ``top_p``, ``top_k`` and
``metadata`` are accepted and ignored. The text blocks of one message are joined with newlines (as vLLM
renders content parts). Images, documents, server tools and forced tool use are refused with the field's
path (`OpenAIRequestError`, a 400); so is ``stream`` here: the server takes it off first and streams the reply
itself (`streams.py`).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from openai.types.chat import ChatCompletion

from areal_agents.engines.model_server.openai_shapes import OpenAIRequestError, stop_strings

# The block types served in each role's content (and in a tool_result's).
BLOCKS_IN = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "thinking", "tool_use"),
    "system": ("text",),
    "tool_result": ("text",),
}
THINKING = {"enabled": True, "adaptive": True, "between_tools": True, "disabled": False}  # -> enable_thinking
# Anthropic's error types by status (the SDK picks its exception class by status: anthropic/_error_classes.py).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def chat_kwargs_from_messages(body: Any) -> dict[str, Any]:
    """A Messages request body as `ChatCapture.create` kwargs; `OpenAIRequestError` names a field it cannot take."""
    if not isinstance(body, dict):
        raise OpenAIRequestError(None, "expects a JSON object")
    if body.get("stream"):
        raise OpenAIRequestError("stream", "the gateway answers whole messages only: send stream false")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise OpenAIRequestError("max_tokens", f"is required: an integer >= 1, got {max_tokens!r}")
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise OpenAIRequestError("messages", "expects a non-empty list of messages")
    messages = _system(body.get("system"))
    for i, message in enumerate(given):
        messages += _chat_messages(message, f"messages[{i}]")
    kwargs: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
    if body.get("tools"):
        kwargs["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        kwargs["tool_choice"] = _tool_choice(body["tool_choice"])
    if stop := stop_strings(body.get("stop_sequences"), "stop_sequences"):
        kwargs["stop"] = stop
    if body.get("thinking") is not None:
        kwargs["chat_template_kwargs"] = {"enable_thinking": _thinking(body["thinking"])}
    return kwargs


def message_from_completion(completion: ChatCompletion, stop: list[str] | None, model: str) -> dict[str, Any]:
    """The ``Message`` of the completion's first choice: thinking, text and tool_use blocks; ``stop`` is the
    request's ``stop_sequences``."""
    choice = completion.choices[0]
    reply = choice.message
    content: list[dict[str, Any]] = []
    if reasoning := (reply.model_extra or {}).get("reasoning_content"):
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    calls = reply.tool_calls or []
    if reply.content or not calls:
        content.append({"type": "text", "text": reply.content or ""})
    for call in calls:
        arguments = json.loads(call.function.arguments)  # the capture's own JSON text of a dict
        content.append({"type": "tool_use", "id": call.id, "name": call.function.name, "input": arguments})
    stop_reason, stop_sequence = _stop_reason(choice, stop or [])
    usage = completion.usage
    return {
        "id": "msg_" + completion.id.removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": usage.prompt_tokens if usage else 0,
            "output_tokens": usage.completion_tokens if usage else 0,
        },
    }


def anthropic_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """Anthropic's error body; ``param`` leads the message (the body has no field for it) unless already there."""
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


def _stop_reason(choice: Any, stop: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a stop string is known by the choice's ``stop_reason`` (`ChatCapture`)."""
    if choice.finish_reason == "tool_calls":
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    hit = (choice.model_extra or {}).get("stop_reason")
    return ("stop_sequence", hit) if hit in stop else ("end_turn", None)


def _system(system: Any) -> list[dict[str, Any]]:
    """``system`` (a string or text blocks) as a leading system message; none when absent or empty."""
    if system is None or isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if not isinstance(system, list):
        raise OpenAIRequestError("system", "expects a string or a list of text blocks")
    text = "\n".join(_block(b, f"system[{k}]", "system")["text"] for k, b in enumerate(system))
    return [{"role": "system", "content": text}] if text else []


def _chat_messages(message: Any, field: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool results become tool messages, its text after."""
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant", "system"):
        raise OpenAIRequestError(f"{field}.role", f"expects 'user', 'assistant' or 'system', got {role!r}")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise OpenAIRequestError(f"{field}.content", "expects a string or a list of content blocks")
    blocks = [_block(b, f"{field}.content[{j}]", role) for j, b in enumerate(content)]
    text = "\n".join(b["text"] for b in blocks if b["type"] == "text")
    if role == "assistant":
        return [_assistant(blocks, text)]
    results = [_tool_message(b, f"{field}.content[{j}]") for j, b in enumerate(blocks) if b["type"] == "tool_result"]
    if results and not any(b["type"] == "text" for b in blocks):
        return results
    return [*results, {"role": role, "content": text}]


def _assistant(blocks: list[dict[str, Any]], text: str) -> dict[str, Any]:
    """An assistant message from checked blocks: thinking -> ``reasoning_content``, tool_use -> ``tool_calls``."""
    out: dict[str, Any] = {"role": "assistant", "content": text}
    thinking = [b["thinking"] for b in blocks if b["type"] == "thinking"]
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    calls = [
        {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}}
        for b in blocks
        if b["type"] == "tool_use"
    ]
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_message(block: dict[str, Any], field: str) -> dict[str, Any]:
    """A tool_result block as a tool message (``is_error`` is in the text the tool wrote, if anywhere)."""
    content = block.get("content")
    if content is None or isinstance(content, str):
        return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content or ""}
    if not isinstance(content, list):
        raise OpenAIRequestError(f"{field}.content", "expects a string or a list of text blocks")
    text = "\n".join(_block(b, f"{field}.content[{k}]", "tool_result")["text"] for k, b in enumerate(content))
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


# The fields each served block type needs, with their JSON types.
BLOCK_FIELDS = {
    "text": {"text": str},
    "thinking": {"thinking": str},
    "tool_use": {"id": str, "name": str, "input": dict},
    "tool_result": {"tool_use_id": str},
}


def _block(block: Any, field: str, where: str) -> dict[str, Any]:
    """``block`` checked: a type served in ``where`` (a role, or a tool_result), with its fields."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in BLOCKS_IN[where]:
        allowed = ", ".join(BLOCKS_IN[where])
        raise OpenAIRequestError(
            f"{field}.type", f"expects {allowed} here (images and documents are not served), got {kind!r}"
        )
    for name, kind_of in BLOCK_FIELDS[kind].items():
        if not isinstance(block.get(name), kind_of):
            raise OpenAIRequestError(f"{field}.{name}", f"expects a {kind_of.__name__} in a {kind} block")
    return block


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Custom tools as OpenAI function tools; server tools (web search, bash, ...) are not served."""
    if not isinstance(tools, list):
        raise OpenAIRequestError("tools", "expects a list of tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise OpenAIRequestError(
                f"tools[{i}].type", f"only custom tools (name, input_schema) are served, got {kind!r}"
            )
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise OpenAIRequestError(f"tools[{i}]", "expects a 'name' (a string) and an 'input_schema' (an object)")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> str:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "none"):
        raise OpenAIRequestError("tool_choice", f"calls are not forced: type 'auto' or 'none', got {choice!r}")
    return kind


def _thinking(thinking: Any) -> bool:
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in THINKING:
        raise OpenAIRequestError("thinking.type", f"expects one of {', '.join(THINKING)}, got {kind!r}")
    return THINKING[kind]
