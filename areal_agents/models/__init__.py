"""Tiny causal LMs and tokenizers the project builds itself, for CPU runs and tests."""

from areal_agents.models.loading import load_model, load_tokenizer
from areal_agents.models.tiny import CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer, save_tiny_model

__all__ = [
    "CHAT_TEMPLATE",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "load_model",
    "load_tokenizer",
    "save_tiny_model",
]
