"""OpenAI's Responses API (``POST /v1/responses``) over `ChatCapture.create`: a request body as chat kwargs,
the `ChatCompletion` back as a ``Response``.

The gateway keeps no responses: a client sends the whole conversation as ``input`` every time, output items
passed back as they came (``previous_response_id`` is refused). ``reasoning.effort`` ``"none"`` turns the
template's thinking off (``enable_thinking``), any other effort on. Sampling comes from the rollout config:
``temperature``, ``top_p``, ``store``, ``metadata``, ``parallel_tool_calls``, ``truncation`` and ``user`` are
accepted and ignored. The text parts of one item are joined with newlines.
"""

from __future__ import annotations

import json
from typing import Any

from openai.types.chat import ChatCompletion

from areal_agents.engines.model_server.openai_shapes import OpenAIRequestError

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")


def chat_kwargs_from_responses(body: Any) -> dict[str, Any]:
    """A Responses request body as `ChatCapture.create` kwargs; `OpenAIRequestError` names a field it cannot take."""
    if not isinstance(body, dict):
        raise OpenAIRequestError(None, "expects a JSON object")
    if body.get("stream"):
        raise OpenAIRequestError("stream", "the gateway answers whole responses only: send stream false")
    if body.get("previous_response_id") is not None:
        raise OpenAIRequestError("previous_response_id", "the gateway keeps no responses: send the whole input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise OpenAIRequestError("instructions", "expects a string")
    head = [{"role": "system", "content": instructions}] if instructions else []
    kwargs: dict[str, Any] = {"messages": head + _input_messages(body.get("input"))}
    if body.get("tools"):
        kwargs["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        if body["tool_choice"] not in ("auto", "none"):
            raise OpenAIRequestError(
                "tool_choice", f"calls are not forced: 'auto' or 'none', got {body['tool_choice']!r}"
            )
        kwargs["tool_choice"] = body["tool_choice"]
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise OpenAIRequestError("max_output_tokens", f"expects an integer >= 1, got {max_tokens!r}")
        kwargs["max_tokens"] = max_tokens
    if (thinking := _thinking(body.get("reasoning"))) is not None:
        kwargs["chat_template_kwargs"] = {"enable_thinking": thinking}
    return kwargs


def response_from_completion(completion: ChatCompletion, model: str) -> dict[str, Any]:
    """The ``Response`` of the completion's first choice: reasoning, message and function_call items."""
    choice = completion.choices[0]
    reply = choice.message
    suffix = completion.id.removeprefix("chatcmpl-")
    truncated = choice.finish_reason == "length"
    output: list[dict[str, Any]] = []
    if reasoning := (reply.model_extra or {}).get("reasoning_content"):
        output.append(
            {"type": "reasoning", "id": f"rs_{suffix}", "summary": [{"type": "summary_text", "text": reasoning}]}
        )
    calls = reply.tool_calls or []
    if reply.content or not calls:
        text = {"type": "output_text", "text": reply.content or "", "annotations": []}
        status = "incomplete" if truncated else "completed"
        output.append(
            {"type": "message", "id": f"msg_{suffix}", "role": "assistant", "status": status, "content": [text]}
        )
    for k, call in enumerate(calls):
        function = {"name": call.function.name, "arguments": call.function.arguments}
        output.append(
            {"type": "function_call", "id": f"fc_{suffix}_{k}", "call_id": call.id, **function, "status": "completed"}
        )
    return {
        "id": f"resp_{suffix}",
        "object": "response",
        "created_at": float(completion.created),
        "model": model,
        "status": "incomplete" if truncated else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "error": None,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": _usage(completion),
    }


def _usage(completion: ChatCompletion) -> dict[str, Any]:
    """Token counts with their details objects (cached and reasoning tokens are not counted apart: 0)."""
    prompt = completion.usage.prompt_tokens if completion.usage else 0
    generated = completion.usage.completion_tokens if completion.usage else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


def _input_messages(given: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: function calls join the assistant message before them, a reasoning item
    goes to the assistant turn after it (an assistant message of its own when none follows)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise OpenAIRequestError("input", "expects a string or a non-empty list of items")
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # of the next assistant turn
    for i, item in enumerate(given):
        field = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "reasoning":
            text = _reasoning(item, field)
            reasoning = text if reasoning is None else f"{reasoning}\n{text}"
            continue
        if kind == "function_call":
            last = messages[-1] if messages else None
            if reasoning is None and last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(_call(item, field))
                continue
            message = {"role": "assistant", "content": "", "tool_calls": [_call(item, field)]}
        elif kind == "function_call_output":
            message = _tool_message(item, field)
        elif kind == "message":
            message = _message(item, field)
        else:
            raise OpenAIRequestError(
                f"{field}.type", f"expects message, function_call, function_call_output or reasoning, got {kind!r}"
            )
        if reasoning is not None and message["role"] == "assistant":
            message["reasoning_content"] = reasoning
        elif reasoning is not None:  # no assistant turn follows it
            messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
        reasoning = None
        messages.append(message)
    if reasoning is not None:
        messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
    return messages


def _message(item: dict[str, Any], field: str) -> dict[str, Any]:
    role = ROLES.get(item.get("role"))
    if role is None:
        raise OpenAIRequestError(f"{field}.role", f"expects one of {', '.join(ROLES)}, got {item.get('role')!r}")
    return {"role": role, "content": _text(item.get("content"), f"{field}.content")}


def _call(item: dict[str, Any], field: str) -> dict[str, Any]:
    """A function_call item as a chat tool call; its id is the ``call_id`` (the capture's call id)."""
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise OpenAIRequestError(f"{field}.{name}", "expects a string")
    try:
        arguments = json.loads(item["arguments"])
    except json.JSONDecodeError as e:
        raise OpenAIRequestError(f"{field}.arguments", f"is not valid JSON ({e})") from e
    if not isinstance(arguments, dict):
        raise OpenAIRequestError(f"{field}.arguments", "expects a JSON object")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}


def _tool_message(item: dict[str, Any], field: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise OpenAIRequestError(f"{field}.call_id", "expects a string: the function_call's call_id")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"), f"{field}.output")}


def _reasoning(item: dict[str, Any], field: str) -> str:
    """A reasoning item's text: its ``content`` (reasoning_text parts) if given, else its ``summary``."""
    if item.get("content"):
        return _text(item["content"], f"{field}.content", ("reasoning_text",))
    return _text(item.get("summary") or [], f"{field}.summary", ("summary_text",))


def _text(content: Any, field: str, kinds: tuple[str, ...] = TEXT_PARTS) -> str:
    """A string, or the text of a list of parts of ``kinds`` joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIRequestError(field, "expects a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise OpenAIRequestError(
                f"{field}[{j}].type", f"expects {' or '.join(kinds)} (only text is served), got {kind!r}"
            )
        if not isinstance(part.get("text"), str):
            raise OpenAIRequestError(f"{field}[{j}].text", "expects a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Function tools as chat tools (``strict`` is not enforced); built-in tools are not served."""
    if not isinstance(tools, list):
        raise OpenAIRequestError("tools", "expects a list of tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise OpenAIRequestError(f"tools[{i}].type", f"only function tools are served, got {kind!r}")
        if not isinstance(tool.get("name"), str):
            raise OpenAIRequestError(f"tools[{i}].name", "expects a string")
        function = {"name": tool["name"]}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _thinking(reasoning: Any) -> bool | None:
    """``reasoning.effort`` as ``enable_thinking``: None when not given."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise OpenAIRequestError("reasoning", "expects an object such as {'effort': 'medium'}")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise OpenAIRequestError("reasoning.effort", f"expects a string such as 'medium', got {effort!r}")
    return None if effort is None else effort != "none"
