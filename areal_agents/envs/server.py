"""Deprecated: moved to `areal_agents.envs.runtime.server`."""

from areal_agents._moved import alias

alias(__name__, "areal_agents.envs.runtime.server")
