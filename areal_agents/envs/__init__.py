"""Gymnasium text environments; importing this module registers the built-in ids.

`TextEnv` (single agent) and `MultiAgentTextEnv` (parallel dict API) are the env APIs; `DatasetEnv` makes
an env from rows; `LocalEnvPool` and `RemoteEnvPool` give the `AsyncEnv` interface that agents use.
"""

from areal_agents.envs.async_env import AsyncEnv
from areal_agents.envs.base import TextEnv, text_space
from areal_agents.envs.dataset_env import DatasetEnv
from areal_agents.envs.multi_agent import MultiAgentTextEnv, check_multi_agent_env
from areal_agents.envs.registry import describe_envs, import_env_module, make_env, register_builtin_envs
from areal_agents.envs.runtime.pool import LocalEnvPool

register_builtin_envs()

__all__ = [
    "AsyncEnv",
    "DatasetEnv",
    "LocalEnvPool",
    "MultiAgentTextEnv",
    "TextEnv",
    "check_multi_agent_env",
    "describe_envs",
    "import_env_module",
    "make_env",
    "text_space",
]
