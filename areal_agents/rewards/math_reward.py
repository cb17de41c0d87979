"""`MathReward`: 1 for a final answer equal to the row's gold answer, else 0 (plus an optional format bonus)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_agents.rewards.base import RewardResult
from areal_agents.rewards.extract import last_boxed, strip_thinking
from areal_agents.rewards.math_verifier import MathVerifyConfig, check_math, warm_up

__all__ = ["MathReward", "warm_up"]  # warm_up: a `WorkerPool` initializer for workers that score math


@dataclass
class MathReward:
    """``reward = correct + format_reward * has_boxed_answer`` (format_reward 0 by default).

    MathReward()("... \\\\boxed{42}", {"answer": "42"})   # RewardResult(reward=1.0, ...)
    """

    answer_key: str = "answer"
    format_reward: float = 0.0
    config: MathVerifyConfig = field(default_factory=MathVerifyConfig)

    def __call__(self, completion: str, row: dict[str, Any]) -> RewardResult:
        if self.answer_key not in row:
            raise KeyError(f"MathReward expects the row to have key {self.answer_key!r}; it has {sorted(row)}")
        check = check_math(completion, str(row[self.answer_key]), self.config)
        formatted = last_boxed(strip_thinking(completion)) is not None
        reward = float(check.correct) + (self.format_reward if formatted else 0.0)
        details = {"correct": check.correct, "answer": check.answer, "method": check.method}
        if check.reason:
            details["reason"] = check.reason
        return RewardResult(reward, details)
