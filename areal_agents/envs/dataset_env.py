"""`DatasetEnv`: one dataset row per episode, chosen by the seed (or ``options={"index": i}``).

The default is a question/answer env: the observation is ``row[prompt_key]``, reward 1 when the action
equals ``row[answer_key]`` after stripping; override `prompt`, `score` and `feedback` for anything else.

    env = DatasetEnv("problems.jsonl", prompt_key="question", answer_key="answer", max_turns=2)
    obs, info = env.reset(seed=3)            # info["index"] is the row, info["num_problems"] how many
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_agents.data.jsonl import read_jsonl
from areal_agents.envs.base import TextEnv


class DatasetEnv(TextEnv):
    """Episodes over the rows of a list or a JSONL file; seeded, reproducible row choice."""

    def __init__(
        self,
        rows: list[dict[str, Any]] | str | Path,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        max_turns: int = 1,
    ) -> None:
        super().__init__()
        self.rows = read_jsonl(rows) if isinstance(rows, (str, Path)) else list(rows)
        if not self.rows:
            raise ValueError("Expects at least one row")
        missing = [i for i, row in enumerate(self.rows) if prompt_key not in row]
        if missing:
            raise ValueError(
                f"Expects every row to have key {prompt_key!r}; row {missing[0]} has {sorted(self.rows[missing[0]])}"
            )
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"Expects max_turns to be an int >= 1, got {max_turns!r}")
        self.prompt_key, self.answer_key, self.max_turns = prompt_key, answer_key, max_turns
        self.row: dict[str, Any] | None = None
        self.index = -1
        self.turn = 0

    def __len__(self) -> int:
        return len(self.rows)

    def prompt(self, row: dict[str, Any]) -> str:
        return str(row[self.prompt_key])

    def score(self, row: dict[str, Any], action: str) -> float:
        return float(action.strip() == str(row.get(self.answer_key, "")).strip())

    def feedback(self, row: dict[str, Any], action: str, reward: float) -> str:
        return "That is not correct. Try again."

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        if options and "index" in options:
            index = int(options["index"])
            if not 0 <= index < len(self.rows):
                raise ValueError(f"options['index'] must be in [0, {len(self.rows)}), got {index}")
        else:
            index = int(self.np_random.integers(len(self.rows)))
        self.index, self.row, self.turn = index, self.rows[index], 0
        return self.prompt(self.row), {"index": index, "role": "user", "num_problems": len(self.rows)}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.row is None:
            raise RuntimeError("Cannot call step() before reset()")
        self.turn += 1
        reward = float(self.score(self.row, action))
        info = {"index": self.index, "turn": self.turn, "role": "user"}
        if reward >= 1.0 or self.turn >= self.max_turns:
            return "", reward, True, False, info
        return self.feedback(self.row, action, reward), reward, False, False, info
