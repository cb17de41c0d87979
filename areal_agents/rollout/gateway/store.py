"""Opt-in retention of rewarded sessions (``gateway.trajectory_dir``): one JSON line per session, in hourly files
(``sessions-YYYYMMDD-HH.jsonl``) so that ``gateway.retention_hours`` deletes whole files; read back by a later
``train`` (``gateway.replay_dir``)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

from areal_agents.errors import ConfigError
from areal_agents.rollout.gateway.session_book import FinishedSession
from areal_agents.types import Trajectory

_PATTERN = "sessions-*.jsonl"


class TrajectoryStore:
    """Appends finished sessions under ``directory``; `prune` deletes files older than ``retention_hours``."""

    def __init__(self, directory: str, retention_hours: float = 0.0) -> None:
        self.directory, self.retention_s = Path(directory), retention_hours * 3600
        self.directory.mkdir(parents=True, exist_ok=True)
        self.written = 0

    def append(self, session: FinishedSession) -> None:
        path = self.directory / time.strftime("sessions-%Y%m%d-%H.jsonl", time.gmtime())
        row = {
            "session_id": session.session_id,
            "task": session.task,
            "reward": session.reward,
            "baseline": session.baseline,
            "written_at": time.time(),
            "trajectories": [_row(t) for t in session.trajectories],
        }
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.written += 1

    def prune(self, now: float | None = None) -> list[Path]:
        """Delete the session files last written more than ``retention_hours`` ago (none when 0)."""
        if not self.retention_s:
            return []
        now = time.time() if now is None else now
        old = [p for p in self.directory.glob(_PATTERN) if now - p.stat().st_mtime > self.retention_s]
        for path in old:
            path.unlink(missing_ok=True)
        return old


def read_sessions(directory: str) -> Iterator[FinishedSession]:
    """The sessions a `TrajectoryStore` wrote under ``directory``, oldest file first; a bad line names its place."""
    files = sorted(Path(directory).glob(_PATTERN))
    if not Path(directory).is_dir():
        raise ConfigError(f"gateway.replay_dir {directory}: no such directory")
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                yield _session(line, f"{path}:{n}")


def _row(t: Trajectory) -> dict:
    row = {f.name: getattr(t, f.name) for f in dataclasses.fields(t)}
    row["metadata"] = json.loads(json.dumps(t.metadata, default=str))
    return row


def _session(line: str, where: str) -> FinishedSession:
    try:
        row = json.loads(line)
        trajectories = [Trajectory(**t) for t in row["trajectories"]]
        return FinishedSession(row["session_id"], row["task"], row["reward"], row["baseline"], trajectories)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{where}: not a session the gateway wrote: {e}") from e
