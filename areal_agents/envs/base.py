"""`TextEnv`: a gymnasium.Env whose observations and actions are strings."""

from __future__ import annotations

import string
from typing import Any

import gymnasium as gym
from gymnasium import spaces

# Everything a chat model may read or write: printable ASCII (tabs, newlines included).
TEXT_CHARSET = frozenset(string.printable)


def text_space(max_length: int) -> spaces.Text:
    """A `gymnasium.spaces.Text` over printable characters, empty strings allowed."""
    return spaces.Text(max_length=max_length, min_length=0, charset=TEXT_CHARSET)


class TextEnv(gym.Env[str, str]):
    """A Gymnasium env with text observations and text actions.

    ``reset(seed, options) -> (observation, info)``; ``step(action) -> (observation, reward, terminated,
    truncated, info)``. The observation is the text the agent reads next; ``info["role"]`` may say its
    chat role (``user`` by default, ``tool`` for tool output).

        class Echo(TextEnv):
            def reset(self, *, seed=None, options=None):
                super().reset(seed=seed)
                return "say hi", {}
            def step(self, action):
                return "", float(action == "hi"), True, False, {}
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, max_observation_length: int = 4096, max_action_length: int = 4096) -> None:
        self.observation_space = text_space(max_observation_length)
        self.action_space = text_space(max_action_length)
