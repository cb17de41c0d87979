"""Tiny causal LMs and tokenizers the project builds itself, for CPU runs and tests."""

from areal_agents.models.families import FAMILIES, Family, build_family_tokenizer, family_of, stop_token_ids
from areal_agents.models.loading import load_model, load_tokenizer
from areal_agents.models.tiny import CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer, save_tiny_model

__all__ = [
    "CHAT_TEMPLATE",
    "FAMILIES",
    "Family",
    "build_family_tokenizer",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "family_of",
    "load_model",
    "load_tokenizer",
    "save_tiny_model",
    "stop_token_ids",
]
