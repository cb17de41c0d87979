"""Agents: play episodes against async envs through an inference engine, token-in/token-out.

Two styles: an `Agent` class driving the env (`ChatAgent`, `ToolAgent`, or your subclass), or agent code
on an OpenAI-style client whose every token is captured (`ChatCapture`, an episode function, or a program
in another process on the HTTP `ChatProxy`).
"""

from areal_agents.agents.base import Agent
from areal_agents.agents.capture import ChatCapture
from areal_agents.agents.chat_agent import ChatAgent
from areal_agents.agents.chat_tokens import ChatTokens
from areal_agents.agents.episode_function import EpisodeFunctionAgent, Task
from areal_agents.agents.factory import make_agent
from areal_agents.agents.proxy import ChatProxy, CommandAgent
from areal_agents.agents.tool_agent import ToolAgent

__all__ = [
    "Agent",
    "ChatAgent",
    "ChatCapture",
    "ChatProxy",
    "ChatTokens",
    "CommandAgent",
    "EpisodeFunctionAgent",
    "Task",
    "ToolAgent",
    "make_agent",
]
