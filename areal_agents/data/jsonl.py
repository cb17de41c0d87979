"""Read JSONL files with errors that name the file and line; write chat JSONL (SFT data)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from areal_agents.errors import ArealAgentsError


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """One JSON object per non-empty line."""
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
            rows.append(row)
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


def write_chat_jsonl(path: str | Path, conversations: Iterable[list[dict[str, str]]]) -> int:
    """Write ``{"messages": [...]}`` rows, what `read_chat_jsonl` and ``areal-agents sft`` read; returns the count."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with p.open("w", encoding="utf-8") as f:
        for messages in conversations:
            f.write(json.dumps({"messages": messages}) + "\n")
            n += 1
    return n
