"""Deprecated: moved to `areal_agents.envs.runtime.remote`."""

from areal_agents._moved import alias

alias(__name__, "areal_agents.envs.runtime.remote")
