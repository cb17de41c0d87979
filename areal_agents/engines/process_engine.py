"""Deprecated: moved to `areal_agents.engines.hf.process_engine`."""

from areal_agents._moved import alias

alias(__name__, "areal_agents.engines.hf.process_engine")
