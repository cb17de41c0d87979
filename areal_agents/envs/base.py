"""`TextEnv`: a gymnasium.Env whose observations and actions are strings."""

from __future__ import annotations

import copy
import functools
import string
import zlib
from typing import Any, Literal

import gymnasium as gym
from gymnasium import spaces

# What `sample()` draws from: printable ASCII (tabs, newlines included). Membership is any Unicode.
TEXT_CHARSET = frozenset(string.printable)


class UnicodeText(spaces.Text):
    """A `gymnasium.spaces.Text` that contains any string of allowed length (math and code problems
    carry Unicode: AIME 2025 has a bullet); `sample()` still draws printable ASCII."""

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length


@functools.lru_cache(maxsize=64)
def _text_space_template(max_length: int) -> UnicodeText:
    return UnicodeText(max_length=max_length, min_length=0, charset=TEXT_CHARSET)


def text_space(max_length: int) -> spaces.Text:
    """The text space of observations and actions: any string up to ``max_length``, empty allowed.

    A copy of a cached instance: building the charset index is not free, and would be paid per episode;
    each copy has its own random generator."""
    space = copy.copy(_text_space_template(max_length))
    space._np_random = None  # noqa: SLF001  (seeded lazily, per copy)
    return space


Split = Literal["all", "train", "test"]  # which problems a generated task draws: a held-out test split, or all


def hash_split(text: str) -> Literal["train", "test"]:
    """A generated problem's split by its text: ~10% test, stable across runs, machines and Python versions."""
    return "test" if zlib.crc32(text.encode()) % 10 == 0 else "train"


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
