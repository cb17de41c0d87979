"""Gymnasium text environments; importing this module registers the built-in ids."""

import gymnasium as gym

from areal_agents.envs.async_env import AsyncEnv, LocalAsyncEnv
from areal_agents.envs.base import TextEnv, text_space
from areal_agents.envs.registry import import_env_module, make_env

if "areal_agents/Arithmetic-v0" not in gym.registry:
    gym.register(id="areal_agents/Arithmetic-v0", entry_point="areal_agents.envs.arithmetic:ArithmeticEnv")

__all__ = ["AsyncEnv", "LocalAsyncEnv", "TextEnv", "import_env_module", "make_env", "text_space"]
