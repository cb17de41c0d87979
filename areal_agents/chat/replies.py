"""What a parsed model reply holds: its visible content, its reasoning, its tool calls and the calls that failed.

A malformed call is never dropped: it becomes a `ToolParseError` that keeps the text the model wrote, so an
env or agent can answer it and a run whose tools never fire shows up in its counters.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A fresh call id: 9 alphanumerics, the one shape every template accepts (Mistral's insists on it)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


@dataclass
class ToolCall:
    """One well-formed tool call.

    call = ToolCall("add", {"a": 1, "b": 2})
    call.to_openai()["function"]["arguments"]  # '{"a": 1, "b": 2}'
    """

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=new_call_id)  # parsed from the text when the format carries one

    def to_openai(self) -> dict[str, Any]:
        """The call as an OpenAI API response gives it: arguments JSON-encoded."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}

    def to_message(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry for chat templates: arguments as a dict
        (Qwen3's and gpt-oss's templates `tojson` them themselves)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolParseError:
    """A call the model tried to make and got wrong; ``raw`` is the call's text exactly as written."""

    raw: str
    message: str  # what is wrong, in words the model can act on

    def __str__(self) -> str:
        return f"error: {self.message}"


@dataclass
class ParsedReply:
    """One generated turn split into content, reasoning, tool calls and malformed calls.

    reply = parse_reply("<think>2+2</think>4", "hermes", "think")
    reply.content, reply.reasoning  # ("4", "2+2")
    """

    content: str  # the visible reply: reasoning and tool calls taken out, stripped
    reasoning: str | None  # None when the reply has no reasoning
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolParseError] = field(default_factory=list)  # malformed calls, in order

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message; ``reasoning_content`` and ``tool_calls`` only when present."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [c.to_message() for c in self.tool_calls]
        return out
