"""Tool-call parsers for the text formats: Hermes/Qwen ``<tool_call>``, Mistral ``[TOOL_CALLS]``, Granite
``<|tool_call|>`` and DeepSeek's tool tokens.

Each takes the reply with its reasoning already taken out and returns a `ToolSplit`. None raises on model
output: every call the model tried to make is either a `ToolCall` or a `ToolParseError` holding its text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from areal_agents.chat.replies import ToolCall, ToolParseError, new_call_id

Found = ToolCall | ToolParseError
Span = tuple[int, int, "Found | None"]  # (start, end, what the span was); None: a marker with no call in it

_DECODER = json.JSONDecoder()
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_CALL_SHAPE = '{"name": ..., "arguments": {...}}'


@dataclass
class ToolSplit:
    """A reply's visible content (calls taken out, stripped), its calls and its malformed calls, in order."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolParseError] = field(default_factory=list)


def _kind(value: Any) -> str:
    """A JSON value's kind in words, for error messages."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


def call_with_arguments(name: str, arguments: Any, raw: str, call_id: str | None = None) -> Found:
    """A call from its name and arguments; arguments may be an object or a JSON-encoded string of one."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            msg = f"the tool call's arguments are a string that is not valid JSON ({e.msg} at character {e.pos})"
            return ToolParseError(raw, msg)
    if not isinstance(arguments, dict):
        return ToolParseError(raw, f"the tool call's arguments must be a JSON object, got {_kind(arguments)}")
    return ToolCall(name, arguments, call_id or new_call_id())


def call_from_object(obj: Any, raw: str) -> Found:
    """A call from a decoded ``{"name": ..., "arguments": {...}}`` (missing arguments: none, ``{}``)."""
    if not isinstance(obj, dict):
        return ToolParseError(raw, f"a tool call must be a JSON object {_CALL_SHAPE}, got {_kind(obj)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        got = "no name" if name is None else f"name {json.dumps(name, ensure_ascii=False)}"
        return ToolParseError(raw, f'the tool call needs a "name" string: {_CALL_SHAPE}; got {got}')
    call_id = obj.get("id")
    call_id = call_id if isinstance(call_id, str) and _MISTRAL_ID.fullmatch(call_id) else None
    return call_with_arguments(name, obj.get("arguments", {}), raw, call_id)


def call_from_json(body: str, raw: str) -> Found:
    """A call from its JSON text."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolParseError(raw, f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    return call_from_object(obj, raw)


def split_spans(text: str, spans: list[Span]) -> ToolSplit:
    """The content (text outside the spans, stripped) and the calls and errors found in the spans."""
    spans = sorted(spans, key=lambda s: s[0])
    parts, pos = [], 0
    out = ToolSplit("")
    for start, end, found in spans:
        parts.append(text[pos:start])
        pos = max(pos, end)
        if isinstance(found, ToolCall):
            out.tool_calls.append(found)
        elif isinstance(found, ToolParseError):
            out.errors.append(found)
    parts.append(text[pos:])
    out.content = "".join(parts).strip()
    return out


def _cut(text: str, start: int, end: int) -> int:
    """``end`` moved back over trailing whitespace (not before ``start``): an unclosed call's text ends there."""
    return max(start, len(text[:end].rstrip()))


def parse_hermes(text: str) -> ToolSplit:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number of them."""
    opening, closing = "<tool_call>", "</tool_call>"
    spans: list[Span] = []
    pos = 0
    while (start := text.find(opening, pos)) != -1:
        body = start + len(opening)
        close, nxt = text.find(closing, body), text.find(opening, body)
        if close == -1 or (nxt != -1 and nxt < close):
            end = _cut(text, start, nxt if nxt != -1 else len(text))
            spans.append((start, end, ToolParseError(text[start:end], f"the tool call is not closed with {closing}")))
            pos = end if nxt == -1 else nxt
            continue
        end = close + len(closing)
        spans.append((start, end, call_from_json(text[body:close].strip(), text[start:end])))
        pos = end
    return split_spans(text, spans)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


@dataclass
class _ListScan:
    """A JSON list decoded element by element: the elements that decoded, with their exact spans, and
    where the list ends; or, when it is malformed, what is wrong and where the bad part starts."""

    items: list[tuple[int, int, Any]]
    end: int | None = None
    problem: str = ""
    bad_from: int | None = None  # None: the whole list is bad (no list, or never closed)


def _scan_list(text: str, start: int) -> _ListScan:
    """Decode the JSON list at ``text[start:]``. A malformed element spoils only itself and what follows; a
    list cut off before its ``]`` is bad as a whole."""
    i = _skip_ws(text, start)
    if i >= len(text) or text[i] != "[":
        return _ListScan([], problem="no JSON list follows it")
    items: list[tuple[int, int, Any]] = []
    i = _skip_ws(text, i + 1)
    if i < len(text) and text[i] == "]":
        return _ListScan(items, end=i + 1)
    while True:
        try:
            value, end = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if e.pos >= len(text):  # cut off: no call of the list runs
                return _ListScan([], problem="the list is not closed with ]")
            return _ListScan(
                items, problem=f"the tool call is not valid JSON ({e.msg} at character {e.pos - i})", bad_from=i
            )
        items.append((i, end, value))
        i = _skip_ws(text, end)
        if i >= len(text):
            return _ListScan([], problem="the list is not closed with ]")
        if text[i] == "]":
            return _ListScan(items, end=i + 1)
        if text[i] != ",":
            return _ListScan(items, problem="expected ',' or ']' after a call", bad_from=i)
        i = _skip_ws(text, i + 1)


def _parse_marked_lists(text: str, marker: str) -> ToolSplit:
    """``MARKER[{call}, {call}, ...]``, as Mistral's ``[TOOL_CALLS]`` and Granite's ``<|tool_call|>`` write."""
    spans: list[Span] = []
    pos = 0
    while (start := text.find(marker, pos)) != -1:
        nxt = text.find(marker, start + len(marker))
        limit = nxt if nxt != -1 else len(text)
        scan = _scan_list(text[:limit], start + len(marker))
        end = scan.end if scan.end is not None else _cut(text, start, limit)
        spans.append((start, end, None))
        spans.extend((s, e, call_from_object(value, text[s:e])) for s, e, value in scan.items)
        if scan.end is None and scan.bad_from is None:
            msg = f"{marker} must be followed by a JSON list of calls [{_CALL_SHAPE}]: {scan.problem}"
            spans.append((start, end, ToolParseError(text[start:end], msg)))
        elif scan.end is None:
            spans.append((scan.bad_from, end, ToolParseError(text[scan.bad_from : end], scan.problem)))
        elif not scan.items:
            msg = f"{marker} is followed by an empty list; write [{_CALL_SHAPE}]"
            spans.append((start, end, ToolParseError(text[start:end], msg)))
        pos = end if scan.end is not None else limit
    return split_spans(text, spans)


def parse_mistral(text: str) -> ToolSplit:
    """Mistral's ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abcDEF123"}]``."""
    return _parse_marked_lists(text, "[TOOL_CALLS]")


def parse_granite(text: str) -> ToolSplit:
    """Granite 3.x's ``<|tool_call|>[{"name": ..., "arguments": {...}}]``."""
    return _parse_marked_lists(text, "<|tool_call|>")


DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _deepseek_call(body: str, raw: str) -> Found:
    """One ``function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```"`` (the type before the separator is not checked)."""
    if DS_SEP not in body:
        return ToolParseError(raw, f"the tool call has no {DS_SEP} before the tool's name")
    name, _, arguments = body.split(DS_SEP, 1)[1].partition("\n")
    if not name.strip():
        return ToolParseError(raw, f"the tool call has no tool name after {DS_SEP}")
    arguments = arguments.strip()
    if arguments.startswith("```"):
        arguments = arguments.partition("\n")[2] if "\n" in arguments else ""
    arguments = arguments.strip().removesuffix("```").strip()
    try:
        decoded = json.loads(arguments)
    except json.JSONDecodeError as e:
        return ToolParseError(raw, f"the tool call's arguments are not valid JSON ({e.msg} at character {e.pos})")
    return call_with_arguments(name.strip(), decoded, raw)


def parse_deepseek(text: str) -> ToolSplit:
    """DeepSeek's ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
    <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``; the outer markers are taken out of the content."""
    spans: list[Span] = []
    for marker in (DS_CALLS_BEGIN, DS_CALLS_END):
        spans.extend((m.start(), m.end(), None) for m in re.finditer(re.escape(marker), text))
    pos = 0
    while (start := text.find(DS_CALL_BEGIN, pos)) != -1:
        body = start + len(DS_CALL_BEGIN)
        close = text.find(DS_CALL_END, body)
        stops = [i for i in (text.find(DS_CALL_BEGIN, body), text.find(DS_CALLS_END, body)) if i != -1]
        stop = min(stops) if stops else len(text)
        if close == -1 or close > stop:
            end = _cut(text, start, stop)
            msg = f"the tool call is not closed with {DS_CALL_END}"
            spans.append((start, end, ToolParseError(text[start:end], msg)))
            pos = stop
            continue
        end = close + len(DS_CALL_END)
        spans.append((start, end, _deepseek_call(text[body:close], text[start:end])))
        pos = end
    return split_spans(text, spans)
