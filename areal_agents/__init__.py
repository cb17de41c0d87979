"""areal-agents: multi-turn RL of language-model agents with interruptible rollouts and decoupled PPO."""

from areal_agents import envs as envs  # registers the built-in gymnasium ids

__version__ = "0.1.0"
