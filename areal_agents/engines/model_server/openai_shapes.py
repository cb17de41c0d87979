"""OpenAI chat shapes shared by serve-model's ``/v1`` routes and the capturing client (`ChatCapture`):
messages as chat templates take them, stop strings, the reply message from the family's `ReplyParser`, and
``logprobs.content``. One place, so that the server and the proxy answer alike."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from areal_agents.chat import ReplyParser

MESSAGE_KEYS = ("tool_call_id", "name", "reasoning_content")  # kept as given, beside role, content, tool_calls


class OpenAIRequestError(ValueError):
    """A request OpenAI's API would refuse (400); ``param`` names the field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


def plain_message(message: Any, field: str = "messages[0]") -> dict[str, Any]:
    """One request message as chat templates take it: ``content`` a string (text parts joined, None -> ""),
    tool calls' ``arguments`` a dict (Qwen3's template ``tojson``s them), ``reasoning_content`` kept."""
    if hasattr(message, "model_dump"):  # the SDK's own objects, passed back by agent code
        message = message.model_dump(exclude_none=True)
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise OpenAIRequestError(field, "expects an object with a 'role' (a string)")
    out: dict[str, Any] = {"role": message["role"], "content": _text(message.get("content"), f"{field}.content")}
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise OpenAIRequestError(f"{field}.tool_calls", "expects a list of tool calls")
        out["tool_calls"] = [_plain_call(c, f"{field}.tool_calls[{j}]") for j, c in enumerate(calls)]
    for key in MESSAGE_KEYS:
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def plain_messages(messages: Any) -> list[dict[str, Any]]:
    """The ``messages`` of a request, each through `plain_message`; at least one."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIRequestError("messages", "expects a non-empty list of chat messages")
    return [plain_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def same_message(given: dict[str, Any], ours: dict[str, Any]) -> bool:
    """``given`` (sent back by agent code) is the message we returned: equal, except that a client may drop
    the non-standard ``reasoning_content`` (SDKs and frameworks do not send it back)."""
    if "reasoning_content" not in given:
        ours = {k: v for k, v in ours.items() if k != "reasoning_content"}
    return given == ours


def _text(content: Any, field: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # content parts: text only
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIRequestError(f"{field}[{k}]", "only text parts ({'type': 'text', 'text': ...}) are served")
            parts.append(part["text"])
        return "".join(parts)
    raise OpenAIRequestError(field, f"expects a string or a list of text parts, got {type(content).__name__}")


def _plain_call(call: Any, field: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise OpenAIRequestError(f"{field}.function", "expects {'name': ..., 'arguments': ...}")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise OpenAIRequestError(f"{field}.function.arguments", f"is not valid JSON ({e})") from e
    out = {"type": call.get("type") or "function", "function": {"name": function["name"], "arguments": arguments}}
    return {"id": call["id"], **out} if call.get("id") else out


def stop_strings(value: Any, field: str = "stop") -> list[str]:
    """``stop``: None, a string, or a list of non-empty strings."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise OpenAIRequestError(field, f"expects a string or a list of non-empty strings, got {value!r}")
    return stops


def cut_at_stop(text: str, stops: list[str]) -> int | None:
    """Where the first of ``stops`` starts in ``text`` (None: none occurs)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def tokens_through(decode, tokens: list[int], chars: int) -> int:
    """The fewest of ``tokens`` whose decoded text is at least ``chars`` long (binary search): a stop string
    ending at ``chars`` was generated by these, and what came after is not part of the reply."""
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(tokens[:mid])) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass
class Generated:
    """One choice's generation, after stop strings: the tokens that make the reply, their logprobs, the text
    (special tokens kept, the final stop token left out), why it ended (``stop``, ``length``, ``abort``) and
    the stop string that ended it (None: none did; Anthropic's ``stop_sequence`` needs it)."""

    tokens: list[int]
    logprobs: list[float]
    text: str
    finish: str
    stop: str | None = None


def generated(
    tokenizer, tokens: list[int], logprobs: list[float], reason: str, stops: list[str], stop_ids: set[int]
) -> Generated:
    """The reply of ``tokens`` (as the engine ended them, ``reason``), cut at the first of ``stops``."""

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    body = tokens[:-1] if reason == "stop" and tokens and tokens[-1] in stop_ids else tokens
    text = decode(body)
    cut = cut_at_stop(text, stops)
    if cut is None:
        return Generated(list(tokens), list(logprobs), text, reason)
    stop = next(s for s in stops if text.startswith(s, cut))
    kept = tokens_through(decode, body, cut + len(stop))
    return Generated(tokens[:kept], logprobs[:kept], text[:cut], "stop", stop)


def reply_message(parser: ReplyParser, text: str, tools: bool) -> tuple[dict[str, Any], list[str]]:
    """The assistant message of ``text`` and the tool-call parse errors (``"error: ..."``).

    Reasoning goes to ``reasoning_content``. With ``tools``, calls become ``tool_calls`` (ids, arguments as
    JSON text); if any call is malformed none is taken and the whole text after the reasoning stays in
    ``content``, as the model wrote it: a reply is never silently short of a call.
    """
    parsed = parser.parse(text) if tools else ReplyParser("none", parser.reasoning_parser).parse(text)
    errors = [str(e) for e in parsed.errors]
    if errors:
        parsed = ReplyParser("none", parser.reasoning_parser).parse(text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
    elif message["content"] is None:
        message["content"] = ""
    return message, errors


def finish_reason(message: dict[str, Any], finish: str) -> str:
    """OpenAI's ``finish_reason``: ``tool_calls`` when the reply calls tools, else the generation's."""
    return "tool_calls" if message.get("tool_calls") else finish


def chat_logprobs(tokenizer, tokens: list[int], logprobs: list[float]) -> dict[str, Any]:
    """``choices[i].logprobs``: each chosen token's text, logprob and UTF-8 bytes (no alternatives)."""
    content = []
    for token, logprob in zip(tokens, logprobs):
        piece = tokenizer.decode([token], skip_special_tokens=False)
        content.append({"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "top_logprobs": []})
    return {"content": content, "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
