"""Gymnasium text environments; importing this module registers the built-in ids.

`TextEnv` (single agent) and `MultiAgentTextEnv` (parallel dict API) are the env APIs; `DatasetEnv` makes
an env from rows; `LocalEnvPool` and `RemoteEnvPool` give the `AsyncEnv` interface that agents use.
"""

import gymnasium as gym

from areal_agents.envs.async_env import AsyncEnv, LocalAsyncEnv
from areal_agents.envs.base import TextEnv, text_space
from areal_agents.envs.dataset_env import DatasetEnv
from areal_agents.envs.multi_agent import MultiAgentTextEnv, check_multi_agent_env
from areal_agents.envs.pool import LocalEnvPool
from areal_agents.envs.registry import describe_envs, import_env_module, make_env

if "areal_agents/Arithmetic-v0" not in gym.registry:
    gym.register(id="areal_agents/Arithmetic-v0", entry_point="areal_agents.envs.arithmetic:ArithmeticEnv")

__all__ = [
    "AsyncEnv",
    "DatasetEnv",
    "LocalAsyncEnv",
    "LocalEnvPool",
    "MultiAgentTextEnv",
    "TextEnv",
    "check_multi_agent_env",
    "describe_envs",
    "import_env_module",
    "make_env",
    "text_space",
]
