"""`areal_agents/Count-v0`: count from one number to another; how far is long-tailed, as reasoning lengths are.

The observation is ``"count 37..41="``; the action is every number from the first to the last
(``"37 38 39 40 41"``); reward 1 for the exact sequence. The count's length is log-normal (median
``median_length`` numbers, spread ``sigma``, capped at ``max_length``), so a batch of answers has a long
tail: the case in which a synchronous RL step waits for its longest sample (bench/async_vs_sync.py).
Problems split into ``train`` / ``test`` by a hash, as Arithmetic-v0's do.

    env = gymnasium.make("areal_agents/Count-v0", median_length=6, max_length=32)
    obs, info = env.reset(seed=0)          # "count 37..41="
    obs, reward, terminated, truncated, info = env.step("37 38 39 40 41")
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from areal_agents.envs.base import Split, TextEnv, hash_split


@dataclass(frozen=True)
class Count:
    first: int
    last: int

    @property
    def text(self) -> str:
        return f"count {self.first}..{self.last}="

    @property
    def answer(self) -> str:
        return " ".join(map(str, range(self.first, self.last + 1)))

    @property
    def split(self) -> Literal["train", "test"]:
        return hash_split(self.text)


def sample_count(
    rng: np.random.Generator, start_below: int, median_length: int, sigma: float, max_length: int, split: Split = "all"
) -> Count:
    """A start uniform in ``[0, start_below)``, a log-normal length in ``[1, max_length]``; other splits rejected."""
    while True:
        first = int(rng.integers(0, start_below))
        length = min(max_length, max(1, round(median_length * math.exp(sigma * rng.standard_normal()))))
        count = Count(first, first + length - 1)
        if split == "all" or count.split == split:
            return count


class CountEnv(TextEnv):
    """Count from ``first`` to ``last``; the count's length is long-tailed (log-normal, capped)."""

    def __init__(
        self,
        median_length: int = 6,
        sigma: float = 0.8,
        max_length: int = 32,
        start_below: int = 100,
        split: Split = "all",
    ) -> None:
        if not isinstance(max_length, int) or not 1 <= max_length <= 1024:
            raise ValueError(f"Expects max_length to be an int in [1, 1024], got {max_length!r}")
        if not isinstance(median_length, int) or not 1 <= median_length <= max_length:
            raise ValueError(
                f"Expects median_length to be an int in [1, max_length={max_length}], got {median_length!r}"
            )
        if isinstance(sigma, bool) or not isinstance(sigma, int | float) or not 0 <= sigma <= 3:
            raise ValueError(f"Expects sigma to be a number in [0, 3], got {sigma!r}")
        if not isinstance(start_below, int) or not 1 <= start_below <= 10**6:
            raise ValueError(f"Expects start_below to be an int in [1, 1000000], got {start_below!r}")
        if split not in ("all", "train", "test"):
            raise ValueError(f"Expects split to be one of 'all', 'train', 'test', got {split!r}")
        width = len(str(start_below + max_length)) + 1  # characters per number, with its space
        super().__init__(max_observation_length=32, max_action_length=2 * width * max_length + 16)
        self.median_length, self.sigma, self.max_length = median_length, float(sigma), max_length
        self.start_below, self.split = start_below, split
        self.count: Count | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self.count = sample_count(
            self.np_random, self.start_below, self.median_length, self.sigma, self.max_length, self.split
        )
        return self.count.text, {"role": "user"}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.count is None:
            raise RuntimeError("Cannot call step() before reset()")
        answer = self.count.answer
        correct = " ".join(action.split()) == answer
        info = {"correct": correct, "answer": answer, "length": self.count.last - self.count.first + 1, "role": "user"}
        return "", float(correct), True, False, info
