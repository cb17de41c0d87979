"""Reasoning parsers: split a reply into its reasoning and the rest, before tool calls are looked for, so that
a call written inside the reasoning stays there and is not run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReasoningSplit:
    """The reasoning (None when the reply has none) and the rest of the reply, where tool calls are parsed."""

    reasoning: str | None
    rest: str


def split_none(text: str) -> ReasoningSplit:
    """No reasoning format: all of the reply is the rest."""
    return ReasoningSplit(None, text)


def _unwrap_response(text: str) -> str:
    """Granite 3.3's thinking mode writes the answer as ``<response>...</response>``: keep what is inside."""
    if "<response>" not in text:
        return text
    before, _, after = text.partition("<response>")
    inside, _, tail = after.partition("</response>")
    return before + inside + tail


def split_think(text: str) -> ReasoningSplit:
    """``<think>...</think>``. The opening tag may be in the generation prompt (DeepSeek-R1, QwQ): then what
    comes before ``</think>`` is the reasoning. An unclosed ``<think>`` (the reply was cut off) is all reasoning."""
    opening, closing = "<think>", "</think>"
    close = text.find(closing)
    start = text.find(opening)
    if start != -1 and (close == -1 or start < close):
        if close == -1:
            return ReasoningSplit(text[start + len(opening) :].strip(), _unwrap_response(text[:start]))
        reasoning = text[start + len(opening) : close]
        rest = text[:start] + text[close + len(closing) :]
    elif close != -1:
        reasoning, rest = text[:close], text[close + len(closing) :]
    else:
        return ReasoningSplit(None, _unwrap_response(text))
    return ReasoningSplit(reasoning.strip(), _unwrap_response(rest))
