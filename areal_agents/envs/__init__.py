"""Gymnasium text environments; importing this module registers the built-in ids.

`TextEnv` (single agent) and `MultiAgentTextEnv` (parallel dict API) are the env APIs; `DatasetEnv` makes
an env from rows; `LocalEnvPool` and `RemoteEnvPool` give the `AsyncEnv` interface that agents use.
"""

import gymnasium as gym

from areal_agents.envs.async_env import AsyncEnv
from areal_agents.envs.base import TextEnv, text_space
from areal_agents.envs.dataset_env import DatasetEnv
from areal_agents.envs.multi_agent import MultiAgentTextEnv, check_multi_agent_env
from areal_agents.envs.registry import describe_envs, import_env_module, make_env
from areal_agents.envs.runtime.pool import LocalEnvPool

for _id, _entry in (
    ("areal_agents/Arithmetic-v0", "areal_agents.envs.arithmetic:ArithmeticEnv"),
    ("areal_agents/Count-v0", "areal_agents.envs.count:CountEnv"),
    ("areal_agents/Math-v0", "areal_agents.envs.math:MathEnv"),
    ("areal_agents/Code-v0", "areal_agents.envs.code:CodeEnv"),
    ("areal_agents/Debate-v0", "areal_agents.envs.debate:DebateEnv"),
):
    if _id not in gym.registry:
        gym.register(id=_id, entry_point=_entry)

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
