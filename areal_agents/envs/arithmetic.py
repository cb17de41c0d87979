"""`areal_agents/Arithmetic-v0`: integer arithmetic, small enough for a tiny model to learn on CPU.

The observation is a problem such as ``"37+58="``; the action is the answer; reward 1 for the exact
integer. With ``max_turns > 1`` a wrong answer gets feedback and another try. Problems are split into
disjoint ``train`` / ``test`` sets by a hash of the problem, so held-out evaluation is truly held out.

    env = gymnasium.make("areal_agents/Arithmetic-v0", digits=2, operators="+-", max_turns=2)
    obs, info = env.reset(seed=0)          # "37+58="
    obs, reward, terminated, truncated, info = env.step("95")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from areal_agents.envs.base import Split, TextEnv, hash_split

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def text(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> int:
        return OPERATORS[self.op](self.a, self.b)

    @property
    def split(self) -> Literal["train", "test"]:
        return hash_split(self.text)


def sample_problem(rng: np.random.Generator, digits: int, operators: str, split: Split = "all") -> Problem:
    """Draw operands uniformly in ``[0, 10**digits)`` and an operator, rejecting other splits."""
    while True:
        a, b = (int(x) for x in rng.integers(0, 10**digits, size=2))
        problem = Problem(a, operators[int(rng.integers(0, len(operators)))], b)  # what rng.choice draws, cheaper
        if split == "all" or problem.split == split:
            return problem


class ArithmeticEnv(TextEnv):
    """Answer ``a op b =`` with the exact integer; optional retries with feedback."""

    def __init__(self, digits: int = 2, operators: str = "+", max_turns: int = 1, split: Split = "all") -> None:
        if not isinstance(digits, int) or not 1 <= digits <= 9:
            raise ValueError(f"Expects digits to be an int in [1, 9], got {digits!r}")
        if not operators or set(operators) - set(OPERATORS):
            raise ValueError(f"Expects operators to be a non-empty string of '+-*', got {operators!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"Expects max_turns to be an int >= 1, got {max_turns!r}")
        if split not in ("all", "train", "test"):
            raise ValueError(f"Expects split to be one of 'all', 'train', 'test', got {split!r}")
        super().__init__(max_observation_length=64 + 2 * digits, max_action_length=256)
        self.digits, self.operators, self.max_turns, self.split = digits, operators, max_turns, split
        self.problem: Problem | None = None
        self.turn = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self.problem = sample_problem(self.np_random, self.digits, self.operators, self.split)
        self.turn = 0
        return self.problem.text, {"role": "user"}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.problem is None:
            raise RuntimeError("Cannot call step() before reset()")
        self.turn += 1
        correct = action.strip() == str(self.problem.answer)
        info = {"correct": correct, "answer": self.problem.answer, "turn": self.turn, "role": "user"}
        if correct or self.turn >= self.max_turns:
            return "", float(correct), True, False, info
        return f"Wrong. Try again: {self.problem.text}", 0.0, False, False, info
