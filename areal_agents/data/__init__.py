"""Datasets and loaders."""

from areal_agents.data.jsonl import read_chat_jsonl, read_jsonl

__all__ = ["read_chat_jsonl", "read_jsonl"]
