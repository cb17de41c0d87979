"""Deprecated: moved to `areal_agents.cluster.ray_launcher`."""

from areal_agents._moved import alias

alias(__name__, "areal_agents.cluster.ray_launcher")
