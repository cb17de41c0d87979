"""The problems an evaluation runs, from a source that works for any env.

An env whose kwargs name a ``dataset`` (a bundled set, a JSONL path or a hub id, as the math and code
envs take it) is evaluated on that dataset's rows, read through the data layer in the order the env
indexes them: problem ``i`` resets with ``options={"index": i}``. An env that holds a fixed set of problems
of its own says so in its reset info (``num_problems``, as `DatasetEnv`, Math-v0 and Code-v0 do) and is
evaluated on indexes 0..n-1. Any other env is evaluated on reset seeds 0..num_problems-1. Nothing here
looks inside an env: it is reset and stepped through `AsyncEnv`.

    problems = await load_problems(settings.env_kwargs, make_env, num_problems=4)
    env = AtProblem(make_env(), problems.problems[0])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_agents.data.base import raw_rows
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.errors import ConfigError
from areal_agents.eval.provenance import rows_digest

ID_KEYS = ("id", "question_id", "task_id")  # a row's own id, as the bundled and public sets name it


@dataclass(frozen=True)
class Problem:
    """One problem: a dataset row (``index`` set) or an env seed (``row`` empty). ``number`` keys its
    samples in ``samples.jsonl``: the row's index, or the seed."""

    number: int
    problem_id: str
    index: int | None = None
    seed: int | None = None
    row: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProblemSet:
    """The problems, what a reader of their scores must know, and the hash of the dataset (None: seeds)."""

    problems: list[Problem]
    notes: list[str] = field(default_factory=list)
    dataset_hash: str | None = None


class AtProblem:
    """An `AsyncEnv` that always resets to one problem: its dataset row, or its seed."""

    def __init__(self, env: AsyncEnv, problem: Problem) -> None:
        self.env, self.problem = env, problem

    async def areset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        if self.problem.index is None:
            return await self.env.areset(seed=self.problem.seed, options=options)
        return await self.env.areset(seed=seed, options={**(options or {}), "index": self.problem.index})

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return await self.env.astep(action)

    async def aclose(self) -> None:
        await self.env.aclose()


async def load_problems(
    env_kwargs: dict[str, Any],
    make_env: Callable[[], AsyncEnv],
    *,
    num_problems: int | None = None,
    date_range: tuple[str, str] | None = None,
    env_id: str = "the env",
) -> ProblemSet:
    """The first ``num_problems`` problems (all rows when None) of the env ``make_env`` builds.

    Raises:
        ConfigError: a multi-agent env; an env without a dataset and no ``num_problems``; no row in
            ``date_range`` (rows whose ``contest_date`` is in [start, end), ISO dates).
    """
    info = await _check_single_agent(make_env, env_id)
    dataset = env_kwargs.get("dataset")
    if not (isinstance(dataset, str) and dataset):
        if isinstance(info.get("num_problems"), int) and info["num_problems"] > 0:
            count = min(num_problems or info["num_problems"], info["num_problems"])
            return ProblemSet([Problem(i, str(i), index=i) for i in range(count)])
        if not num_problems:
            raise ConfigError(f"{env_id} has no dataset: give --num-problems (episodes reset with seeds 0..N-1)")
        return ProblemSet([Problem(k, f"seed{k}", seed=k) for k in range(num_problems)])
    rows = list(raw_rows(dataset, env_kwargs.get("split")))
    chosen = [(i, row) for i, row in enumerate(rows) if _in_window(row, date_range)]
    if not chosen:
        raise ConfigError(f"no problem of {dataset} has a contest_date in {date_range}")
    chosen = chosen[:num_problems] if num_problems else chosen
    problems = [Problem(i, _row_id(row, i), index=i, row=row) for i, row in chosen]
    return ProblemSet(problems, _notes(rows), rows_digest(rows))


async def _check_single_agent(make_env: Callable[[], AsyncEnv], env_id: str) -> dict[str, Any]:
    """Build and reset the env once: bad env kwargs fail here, before anything is written; a multi-agent
    env (observations by agent) is refused. The reset's info."""
    env = make_env()
    try:
        observation, info = await env.areset(seed=0)
    finally:
        await env.aclose()
    if isinstance(observation, dict):
        raise ConfigError(f"{env_id} is a multi-agent env; eval runs single-agent envs")
    return info


def _row_id(row: dict[str, Any], index: int) -> str:
    return next((str(row[k]) for k in ID_KEYS if k in row), str(index))


def _in_window(row: dict[str, Any], window: tuple[str, str] | None) -> bool:
    if window is None:
        return True
    date = str(row.get("contest_date") or "")[:10]
    return bool(date) and window[0] <= date < window[1]


def _notes(rows: list[dict[str, Any]]) -> list[str]:
    """What a reader of the scores must know: LiveCodeBench rows without hidden tests."""
    if rows and "question_content" in rows[0] and not any(r.get("private_test_cases") for r in rows):
        return [
            "LiveCodeBench public tests only: these scores are not comparable to published LiveCodeBench scores, "
            "which judge hidden tests too"
        ]
    return []
