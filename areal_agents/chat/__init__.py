"""Parsing what a model wrote: tool calls in each model family's format and its reasoning, never silently.

Layer 1: imports only `areal_agents.types`/`errors` and the standard library.
"""

from areal_agents.chat.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ReasoningParser,
    ReplyParser,
    ToolParser,
    detect_parsers,
    parse_reply,
)
from areal_agents.chat.replies import ParsedReply, ToolCall, ToolParseError, new_call_id

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ParsedReply",
    "ReasoningParser",
    "ReplyParser",
    "ToolCall",
    "ToolParseError",
    "ToolParser",
    "detect_parsers",
    "new_call_id",
    "parse_reply",
]
