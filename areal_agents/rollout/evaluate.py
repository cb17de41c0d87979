"""Deprecated: moved to `areal_agents.rollout.held_out`."""

from areal_agents._moved import alias

alias(__name__, "areal_agents.rollout.held_out")
