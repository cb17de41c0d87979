"""Read JSONL files with errors that name the file and line; write chat JSONL (SFT data)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_agents.errors import ArealAgentsError


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """One JSON object per non-empty line."""
    return [row for _, row in _numbered_rows(path)]


def _numbered_rows(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-empty line, so later checks can name the line."""
    p = Path(path)
    if not p.is_file():
        raise ArealAgentsError(f"data file not found: {p}")
    rows = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ArealAgentsError(f"{p}:{lineno}: not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ArealAgentsError(f"{p}:{lineno}: expects a JSON object, got {type(row).__name__}")
            rows.append((lineno, row))
    if not rows:
        raise ArealAgentsError(f"data file is empty: {p}")
    return rows


def read_chat_jsonl(path: str | Path) -> list[list[dict[str, str]]]:
    """Conversations from ``{"messages": [{"role": ..., "content": ...}, ...]}`` rows."""
    conversations = []
    for lineno, row in enumerate(read_jsonl(path), 1):
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ArealAgentsError(f"{path}: row {lineno}: expects a non-empty list under key 'messages'")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ArealAgentsError(
                    f"{path}: row {lineno}: each message needs string 'role' and 'content', got {m!r}"
                )
        if not any(m["role"] == "assistant" for m in messages):
            raise ArealAgentsError(f"{path}: row {lineno}: no assistant message to learn from")
        conversations.append(messages)
    return conversations


@dataclass
class SFTExample:
    """One SFT row: OpenAI chat messages (tool calls and tool results allowed), the tool schemas the chat
    template lists for it (None: no tools), and where it came from (``file:line``, for errors)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    source: str


def read_sft_jsonl(path: str | Path) -> list[SFTExample]:
    """``{"messages": [...], "tools": [...]}`` rows (``tools`` optional), what ``areal-agents sft`` reads: each
    message has a string ``role`` and string ``content``; assistant ``tool_calls`` name a function; a bad row
    raises naming ``file:line`` and what is wrong."""
    examples = []
    for lineno, row in _numbered_rows(path):
        where = f"{path}:{lineno}"
        messages, tools = row.get("messages"), row.get("tools")
        if not isinstance(messages, list) or not messages:
            raise ArealAgentsError(f"{where}: expects a non-empty list under key 'messages'")
        for i, m in enumerate(messages):
            _check_message(m, f"{where}: messages[{i}]")
        if not any(m["role"] == "assistant" for m in messages):
            raise ArealAgentsError(f"{where}: no assistant message to learn from")
        if tools is not None:
            if not isinstance(tools, list) or not all(_function_name(t) for t in tools):
                raise ArealAgentsError(
                    f"{where}: 'tools' expects a list of OpenAI tool schemas "
                    f"({{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}), got {tools!r}"
                )
        examples.append(SFTExample(messages, tools, where))
    return examples


def _check_message(m: Any, where: str) -> None:
    """A chat message: string role and content; an assistant's ``tool_calls`` each name a function."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise ArealAgentsError(f"{where}: each message needs string 'role' and 'content', got {m!r}")
    calls = m.get("tool_calls")
    if calls is None:
        return
    if m["role"] != "assistant" or not isinstance(calls, list):
        raise ArealAgentsError(f"{where}: 'tool_calls' expects a list, on an assistant message, got {m!r}")
    for call in calls:
        args = call.get("function", {}).get("arguments") if isinstance(call, dict) else None
        if not _function_name(call) or not isinstance(args, (dict, str)):
            raise ArealAgentsError(
                f"{where}: each tool call needs {{'function': {{'name': str, 'arguments': object or JSON string}}}}, "
                f"got {call!r}"
            )


def _function_name(entry: Any) -> str | None:
    """``entry["function"]["name"]`` when it is a non-empty string (a tool schema or a tool call)."""
    function = entry.get("function") if isinstance(entry, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) and name else None


def write_chat_jsonl(
    path: str | Path,
    conversations: Iterable[list[dict[str, Any]]],
    tools: list[dict[str, Any]] | None = None,
) -> int:
    """Write ``{"messages": [...]}`` rows (with ``"tools": tools`` on each when given), what `read_sft_jsonl` and
    ``areal-agents sft`` read; returns the count."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with p.open("w", encoding="utf-8") as f:
        for messages in conversations:
            row: dict[str, Any] = {"messages": messages} if tools is None else {"messages": messages, "tools": tools}
            f.write(json.dumps(row) + "\n")
            n += 1
    return n
