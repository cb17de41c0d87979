"""Deprecated: moved to `areal_agents.rewards.math_verifier`."""

from areal_agents._moved import alias

alias(__name__, "areal_agents.rewards.math_verifier")
