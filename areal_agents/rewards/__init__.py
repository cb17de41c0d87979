"""Rewards: answer extraction and math verification (more in later modules)."""

from areal_agents.rewards.extract import extract_answer, strip_thinking
from areal_agents.rewards.math_verifier import MathVerifyConfig, check_math, verify_math

__all__ = ["MathVerifyConfig", "check_math", "extract_answer", "strip_thinking", "verify_math"]
