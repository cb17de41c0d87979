"""Deprecated: moved to `areal_agents.engines.hf.request_checks`."""

from areal_agents._moved import alias

alias(__name__, "areal_agents.engines.hf.request_checks")
