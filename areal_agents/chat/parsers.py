"""Choosing and running the parsers: `parse_reply` splits a generated turn into reasoning, content and tool
calls; `detect_parsers` picks the formats from a chat template's text; `ReplyParser` holds the pair.

``text`` is the generated turn decoded with special tokens kept, minus the final stop token. Reasoning is
split first, then tool calls are parsed from the rest, so a call written inside the reasoning is not a call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from areal_agents.chat.harmony import parse_harmony, split_harmony_reasoning
from areal_agents.chat.reasoning import ReasoningSplit, split_none, split_think
from areal_agents.chat.replies import ParsedReply
from areal_agents.chat.tool_formats import (
    ToolSplit,
    parse_deepseek,
    parse_granite,
    parse_hermes,
    parse_mistral,
)
from areal_agents.errors import ArealAgentsError, did_you_mean

ToolParser = Callable[[str], ToolSplit]
ReasoningParser = Callable[[str], ReasoningSplit]


def _no_tools(text: str) -> ToolSplit:
    """No tool-call format: the whole reply is content."""
    return ToolSplit(text.strip())


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": parse_hermes,
    "mistral": parse_mistral,
    "deepseek": parse_deepseek,
    "harmony": parse_harmony,
    "granite": parse_granite,
    "none": _no_tools,
}
REASONING_PARSERS: dict[str, ReasoningParser] = {
    "think": split_think,
    "harmony": split_harmony_reasoning,
    "none": split_none,
}

# (marker in the template text, tool parser), first match wins: gpt-oss's template is checked before the
# others because its tool calls are channels, not tags.
_TOOL_MARKERS = [
    ("<|channel|>", "harmony"),
    ("tool▁calls▁begin", "deepseek"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|tool_call|>", "granite"),
    ("<tool_call>", "hermes"),
]


def detect_parsers(chat_template: str | None) -> tuple[str, str]:
    """(tool parser, reasoning parser) from markers in the template's text. None or a template with no known
    marker gives ("hermes", "none"): the project's own ChatML template has none, and its ToolEnv speaks Hermes."""
    text = chat_template or ""
    tool = next((name for marker, name in _TOOL_MARKERS if marker in text), "hermes")
    if tool == "harmony":
        return tool, "harmony"
    return tool, "think" if "<think>" in text or "</think>" in text else "none"


def _check(field: str, name: str, choices: dict[str, object]) -> None:
    if name not in choices:
        raise ArealAgentsError(
            f"{field} {name!r} is not a known parser; choose one of {', '.join(choices)}"
            f" (or 'auto' to detect it from the chat template).{did_you_mean(name, choices)}"
        )


def parse_reply(text: str, tool_parser: str = "hermes", reasoning_parser: str = "think") -> ParsedReply:
    """Split one generated turn into content, reasoning, tool calls and malformed calls; never raises on
    model output (an unknown parser name raises `ArealAgentsError`)."""
    _check("tool_parser", tool_parser, TOOL_PARSERS)
    _check("reasoning_parser", reasoning_parser, REASONING_PARSERS)
    split = REASONING_PARSERS[reasoning_parser](text)
    tools = TOOL_PARSERS[tool_parser](split.rest)
    return ParsedReply(tools.content, split.reasoning, tools.tool_calls, tools.errors)


@dataclass(frozen=True)
class ReplyParser:
    """The parsers chosen for one tokenizer; what agents and servers hold.

    parser = ReplyParser.for_template(tokenizer.chat_template)  # e.g. ("hermes", "think") for Qwen3
    reply = parser.parse(tokenizer.decode(new_tokens[:-1], skip_special_tokens=False))
    reply.tool_calls, reply.errors
    """

    tool_parser: str
    reasoning_parser: str

    def __post_init__(self) -> None:
        _check("tool_parser", self.tool_parser, TOOL_PARSERS)
        _check("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)

    def parse(self, text: str) -> ParsedReply:
        """Split one generated turn (special tokens kept, final stop token left out)."""
        return parse_reply(text, self.tool_parser, self.reasoning_parser)

    @classmethod
    def for_template(
        cls, chat_template: str | None, tool_parser: str = "auto", reasoning_parser: str = "auto"
    ) -> ReplyParser:
        """The parsers for a chat template: "auto" detects each from the template's text; a name overrides."""
        detected_tool, detected_reasoning = detect_parsers(chat_template)
        return cls(
            detected_tool if tool_parser == "auto" else tool_parser,
            detected_reasoning if reasoning_parser == "auto" else reasoning_parser,
        )
