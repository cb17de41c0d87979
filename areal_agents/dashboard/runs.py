"""The run directories the operator named, and every path the dashboard reads inside them.

A client names a run by its index or its name and a step by its number; the path is built here from those, so
nothing a client sends ever becomes a path. Files being written are read up to their last complete line.

    runs = RunSet.of(["runs/arith/rl", "runs/arith/rl-lr3e-4"])
    run = runs.get("1")                       # or runs.get("rl-lr3e-4")
    rows, skipped = read_jsonl(run.dump("trajectories", 3))
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_agents.errors import ArealAgentsError, did_you_mean

DUMP_KINDS = ("trajectories", "eval_samples")  # RUN/<kind>/step_N.jsonl: training data, held-out eval samples
MAX_STEP = 10**9
_STEP_FILE = re.compile(r"step_(\d{1,10})\.jsonl")


class ClientError(ArealAgentsError):
    """A request the dashboard refuses: ``status`` is its HTTP status (400 or 404), the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Run:
    """One run directory given on the command line; ``name`` is unique among the dashboard's runs."""

    index: int
    name: str
    path: Path

    def dump(self, kind: str, step: int) -> Path:
        """The JSONL file of ``kind`` (one of `DUMP_KINDS`) at ``step``; it may not exist."""
        return self.path / kind / f"step_{step}.jsonl"

    def dump_steps(self, kind: str) -> list[int]:
        """The steps that have a ``kind`` file, ascending."""
        try:
            names = [p.name for p in (self.path / kind).iterdir()]
        except OSError:  # none yet (or unreadable)
            return []
        return sorted(int(m.group(1)) for name in names if (m := _STEP_FILE.fullmatch(name)))


@dataclass(frozen=True)
class RunSet:
    """The runs the dashboard may read, in command-line order; nothing outside them is opened."""

    runs: tuple[Run, ...]

    @classmethod
    def of(cls, paths: list[str | Path]) -> RunSet:
        """Runs from directories; a missing one is an error (a run that has not started yet has its directory)."""
        if not paths:
            raise ArealAgentsError("the dashboard needs at least one run directory")
        runs, names = [], set()
        for i, given in enumerate(paths):
            path = Path(given).resolve()
            if not path.is_dir():
                raise ArealAgentsError(f"run directory not found: {given} (a train run's run_dir)")
            name = path.name
            if name in names:  # two runs called `rl` in different folders: `parent/rl`, else `rl-2`
                name = f"{path.parent.name}/{path.name}"
                name = name if name not in names else f"{path.name}-{i}"
            names.add(name)
            runs.append(Run(i, name, path))
        return cls(tuple(runs))

    def get(self, key: str) -> Run:
        """The run a client named by index (``"0"``) or name; 404 naming the choices otherwise."""
        if key.isdigit() and len(key) < 6:
            if int(key) < len(self.runs):
                return self.runs[int(key)]
            raise ClientError(404, f"run: no run {key}; runs are 0..{len(self.runs) - 1}")
        for run in self.runs:
            if run.name == key:
                return run
        names = [r.name for r in self.runs]
        raise ClientError(404, f"run: no run named {key[:80]!r}; runs: {', '.join(names)}.{did_you_mean(key, names)}")


def parse_step(text: str) -> int:
    """A step number from a client: a non-negative integer (400 naming the field otherwise)."""
    if not (text.isascii() and text.isdigit()) or len(text) > 10 or int(text) > MAX_STEP:
        raise ClientError(400, f"step: expects a step number (0..{MAX_STEP}), got {text[:40]!r}")
    return int(text)


def parse_kind(text: str) -> str:
    """Which dump: ``trajectories`` (training data) or ``eval_samples`` (held-out eval)."""
    if text not in DUMP_KINDS:
        raise ClientError(400, f"kind: expects one of {', '.join(DUMP_KINDS)}, got {text[:40]!r}")
    return text


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows of a JSONL file and how many lines were skipped: a last line still being written (no newline
    yet) is left for the next read, and a line that is not a JSON object is skipped, not fatal."""
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]  # up to the last newline: a partial line is not read yet
    rows, skipped = [], 0 if len(complete) == len(data) else 1
    for line in complete.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            skipped += 1
    return rows, skipped
