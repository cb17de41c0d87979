"""Datasets and loaders."""

from areal_agents.data.base import BaseDataset, load_task_dataset
from areal_agents.data.jsonl import SFTExample, read_chat_jsonl, read_jsonl, read_sft_jsonl, write_chat_jsonl

__all__ = [
    "BaseDataset",
    "SFTExample",
    "load_task_dataset",
    "read_chat_jsonl",
    "read_jsonl",
    "read_sft_jsonl",
    "write_chat_jsonl",
]
