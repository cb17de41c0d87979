"""`RewardFunction`: score a completion against its task row; sync or async, a float or a `RewardResult`.

    class ExactMatch:
        def __call__(self, completion: str, row: dict) -> float:
            return float(completion.strip() == row["answer"])

Named from config as ``module:Class``. Sync functions run in the `RewardService`'s worker processes, so
they must be picklable (a module-level function or class instance).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class RewardResult:
    reward: float
    details: dict[str, Any] = field(default_factory=dict)


class RewardFunction(Protocol):
    def __call__(self, completion: str, row: dict[str, Any]) -> float | RewardResult: ...


def as_result(value: float | RewardResult) -> RewardResult:
    return value if isinstance(value, RewardResult) else RewardResult(float(value))
