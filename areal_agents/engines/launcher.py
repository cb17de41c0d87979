"""Deprecated: moved to `areal_agents.engines.local_servers`."""

from areal_agents._moved import alias

alias(__name__, "areal_agents.engines.local_servers")
