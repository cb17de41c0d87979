"""Agents: play episodes against async envs through an inference engine, token-in/token-out."""

from areal_agents.agents.base import Agent
from areal_agents.agents.chat_agent import ChatAgent
from areal_agents.agents.chat_tokens import ChatTokens

__all__ = ["Agent", "ChatAgent", "ChatTokens"]
