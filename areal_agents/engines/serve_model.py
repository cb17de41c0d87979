"""Deprecated: moved to `areal_agents.engines.model_server`."""

from areal_agents._moved import alias

alias(__name__, "areal_agents.engines.model_server")
