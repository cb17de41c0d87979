"""Assistant messages as each chat template reads them.

Real templates disagree on the shape of an assistant message: gpt-oss reads ``thinking`` where Qwen3 reads
``reasoning_content``, DeepSeek-R1 joins tool-call arguments as text, Granite renders no ``tool_calls`` at all.
`template_message` adapts an OpenAI message to the template before rendering, for the agents' token
bookkeeping and serve-model's OpenAI routes alike.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from areal_agents.chat.parsers import ReplyParser
from areal_agents.errors import ArealAgentsError


@functools.lru_cache(maxsize=64)
def template_reads(chat_template: str | None) -> frozenset[str]:
    """The assistant-message fields a chat template renders: ``tool_calls``, ``reasoning_content``, ``thinking``.
    A field it does not read stays in the message's text, so that the history renders what was generated."""
    text = chat_template or ""
    return frozenset(f for f in ("tool_calls", "reasoning_content", "thinking") if f in text)


def template_message(chat_template: str | None, message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI assistant message in the fields ``chat_template`` reads: ``reasoning_content`` becomes
    ``thinking`` where the template reads only that (gpt-oss); tool-call arguments are JSON text where the
    template joins them as strings (DeepSeek-R1); calls go into the content, in the format the template's
    tool parser reads, where it renders no ``tool_calls`` (Granite)."""
    reads = template_reads(chat_template)
    message = dict(message)
    if message.get("reasoning_content") is not None and "reasoning_content" not in reads and "thinking" in reads:
        message["thinking"] = message.pop("reasoning_content")
    calls = message.get("tool_calls")
    if not calls:
        return message
    if "tool_calls" not in reads:
        written = _calls_as_text(ReplyParser.for_template(chat_template).tool_parser, calls)
        message.pop("tool_calls")
        message["content"] = (message.get("content") or "") + written
    elif "['function']['arguments'] +" in (chat_template or ""):
        message["tool_calls"] = [_arguments_as_text(c) for c in calls]
    return message


def _arguments_as_text(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"]["arguments"]
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {**call, "function": {**call["function"], "arguments": text}}


def _calls_as_text(tool_parser: str, calls: list[dict[str, Any]]) -> str:
    """Calls written into a reply's text in the format ``tool_parser`` reads (for templates that render
    no ``tool_calls``)."""
    objects = [
        {"name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])} for c in calls
    ]
    if tool_parser == "granite":
        return "<|tool_call|>" + json.dumps(objects, ensure_ascii=False)
    if tool_parser == "hermes":
        return "".join(f"<tool_call>\n{json.dumps(o, ensure_ascii=False)}\n</tool_call>" for o in objects)
    raise ArealAgentsError(f"cannot write tool calls in the {tool_parser!r} format into a reply's text")


def _arguments_object(arguments: Any) -> Any:
    """Arguments as the model writes them in text: an object (an OpenAI client sends them JSON-encoded)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # not JSON: written as the string it is
    return arguments
