"""areal-agents: multi-turn RL of language-model agents with interruptible rollouts and decoupled PPO."""

from areal_agents import _moved
from areal_agents import envs as envs  # registers the built-in gymnasium ids

_moved.install()  # old module paths keep importing for one release (a DeprecationWarning names the new one)

__version__ = "0.1.0"
