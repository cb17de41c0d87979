"""gpt-oss's harmony format: a reply is a run of messages, each ``<|start|>assistant<|channel|>CHANNEL
[to=functions.NAME] [<|constrain|>]json<|message|>BODY<|end|>`` (or ``<|call|>``/``<|return|>``).

The generated text starts after the generation prompt ``<|start|>assistant``, so its first message has no
``<|start|>assistant``, and the final stop token is not in it. Reasoning is the analysis channel; a message
with a recipient (``to=functions.NAME``, before or after the channel) is a tool call; the rest is content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from areal_agents.chat.reasoning import ReasoningSplit
from areal_agents.chat.replies import ToolParseError
from areal_agents.chat.tool_formats import ToolSplit, call_with_arguments

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
_TERMINATOR = re.compile(r"<\|(?:end|call|return)\|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class HarmonyMessage:
    """One message of a reply; ``raw`` is its exact text, ``body`` None when ``<|message|>`` never came."""

    raw: str
    channel: str | None
    recipient: str | None
    body: str | None


def _message(raw: str) -> HarmonyMessage:
    """Parse one message's raw text (its ``<|start|>`` included, if it had one)."""
    header, sep, body = raw.partition(MESSAGE)
    if not sep:
        header, body_or_none = raw, None
    else:
        terminator = _TERMINATOR.search(body)
        body_or_none = body[: terminator.start()] if terminator else body
    channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
    return HarmonyMessage(raw, channel and channel.group(1), recipient and recipient.group(1), body_or_none)


def split_messages(text: str) -> list[HarmonyMessage]:
    """The reply's messages in order. Text with no harmony markup is one message with no channel; text
    after a message's terminator that no ``<|start|>`` opens is a message of its own, with no channel."""
    if CHANNEL not in text and MESSAGE not in text:
        return [HarmonyMessage(text, None, None, text)] if text else []
    out: list[HarmonyMessage] = []
    starts = [0] + [m.start() for m in re.finditer(re.escape(START), text) if m.start() > 0] + [len(text)]
    for a, b in zip(starts, starts[1:], strict=False):
        piece = text[a:b]
        terminator = _TERMINATOR.search(piece, piece.find(MESSAGE) + 1) if MESSAGE in piece else None
        if terminator and piece[terminator.end() :].strip():
            out.append(_message(piece[: terminator.end()]))
            stray = piece[terminator.end() :]
            out.append(HarmonyMessage(stray, None, None, stray))
        elif piece:
            out.append(_message(piece))
    return out


def split_harmony_reasoning(text: str) -> ReasoningSplit:
    """The analysis channel's messages (those not addressed to a tool) are the reasoning."""
    messages = split_messages(text)
    thoughts = [m for m in messages if m.channel == "analysis" and m.recipient is None]
    if not thoughts:
        return ReasoningSplit(None, text)
    reasoning = "\n".join((m.body or "").strip() for m in thoughts).strip()
    kept = {id(m) for m in thoughts}
    return ReasoningSplit(reasoning, "".join(m.raw for m in messages if id(m) not in kept))


def parse_harmony(text: str) -> ToolSplit:
    """Messages with a recipient are tool calls (``functions.NAME`` -> ``NAME``; another recipient, such as
    a built-in ``python``, keeps its whole name); the bodies of the others are the content."""
    out = ToolSplit("")
    content: list[str] = []
    for m in split_messages(text):
        if m.recipient is None:
            if m.body and m.body.strip():
                content.append(m.body.strip())
            continue
        name = m.recipient.removeprefix("functions.")
        raw = m.raw.strip()
        if not name:
            out.errors.append(ToolParseError(raw, f"the tool call's recipient {m.recipient!r} has no tool name"))
            continue
        if m.body is None:
            msg = f"the tool call to {name} was cut off before {MESSAGE} and its arguments"
            out.errors.append(ToolParseError(raw, msg))
            continue
        try:
            arguments = json.loads(m.body)
        except json.JSONDecodeError as e:
            msg = f"the tool call's arguments are not valid JSON ({e.msg} at character {e.pos})"
            out.errors.append(ToolParseError(raw, msg))
            continue
        found = call_with_arguments(name, arguments, raw)
        if isinstance(found, ToolParseError):
            out.errors.append(found)
        else:
            out.tool_calls.append(found)
    out.content = "\n".join(content)
    return out
