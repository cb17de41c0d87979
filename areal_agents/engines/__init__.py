"""Inference engines behind one protocol: token ids in, token ids + logprobs + versions out."""

from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.hf.engine import HFEngine

__all__ = ["HFEngine", "InferenceEngine"]
