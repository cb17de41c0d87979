"""What a run holds on env servers it did not start (``env.server_url``), and how it gives it back.

Its sessions there carry the run's owner name (`run_owner`: stable for a run directory on a host). Every
exit path closes them: `RunSessions.close` in the event loop (the pool's own sessions), `RunSessions.release`
after it (every session of the owner, by ``DELETE /v2/sessions?owner=``, if the loop's close did not finish).
A SIGKILL runs no exit path: the run directory's ``owner.json`` (the owner, the driver's pid, its host and
the servers; removed at release) tells the next start of that directory, which closes what the killed run
left open before it opens anything (`RunSessions.claim`). A v1-only server has no close by owner: there a
killed run's sessions end by the server's idle expiry.

The servers and processes a run starts are stopped by their owners (`EnvBackend.aclose` in the loop:
`close_in_loop`; `TrainablePolicy.close` and `Launcher.shutdown` after it: `stop_after_loop`), each whatever
the others raise, and die with the driver when it is killed (`areal_agents.workers`).

Example::

    sessions = RunSessions.claim(run_dir, cfg)  # a killed run's sessions closed; raises if one still runs
    sessions.hold()  # owner.json: this process holds the run directory now
    try:
        ...  # pools made with owner=sessions.owner; `await sessions.close(pool)` in the loop's finally
    finally:
        sessions.release()
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import socket
from collections.abc import Iterable
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_agents.config import TrainConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.envs.runtime.backends import EnvBackend
from areal_agents.envs.runtime.remote import RemoteEnvPool, close_owned
from areal_agents.errors import ConfigError
from areal_agents.progress import note, plural
from areal_agents.trainers.policy_api import Launcher, TrainablePolicy

RECORD = "owner.json"
CLOSE_TIMEOUT_S = 15.0  # the longest a stopping run waits on an env server to close its sessions


def run_owner(run_dir: str | Path) -> str:
    """The owner name of the run in ``run_dir``: its directory's name and a hash of host and absolute path
    (two runs of one name on two hosts, or in two places, never share an owner)."""
    path = Path(run_dir).resolve()
    digest = hashlib.sha256(f"{socket.gethostname()}:{path}".encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", path.name)[:80] or "run"
    return f"areal:{name}:{digest}"


def external_servers(cfg: TrainConfig) -> list[str]:
    """The env servers of ``cfg`` the run did not start (``env.server_url``; none on Ray, whose run starts its own)."""
    env = cfg.env
    if cfg.launcher == "local" and env.backend == "server" and env.server_url:
        return [env.server_url.rstrip("/")]
    return []


@dataclass
class RunSessions:
    """The run's sessions on env servers it did not start (see the module docstring)."""

    run_dir: Path
    owner: str
    servers: list[str]
    closed: bool = False  # the loop closed the pool's sessions

    @classmethod
    def claim(cls, run_dir: str | Path, cfg: TrainConfig) -> RunSessions:
        """The sessions of the run in ``run_dir``, before it writes anything there: `ConfigError` if another
        process of this host still runs there; a record left by a process that is gone (killed) has its
        sessions closed now. Writes nothing: `hold` does."""
        run_dir = Path(run_dir)
        held = cls(run_dir, run_owner(run_dir), external_servers(cfg))
        previous = _read(run_dir / RECORD)
        if previous is not None:
            held._reclaim(previous)
        return held

    def hold(self) -> None:
        """Record in the run directory that this process holds it and may open sessions (`release` removes it)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        record = {"owner": self.owner, "pid": os.getpid(), "started": _started(os.getpid()), "host": _host()}
        _write(self.run_dir / RECORD, {**record, "servers": self.servers})

    def _reclaim(self, previous: dict[str, Any]) -> None:
        pid, owner = int(previous.get("pid", 0)), str(previous.get("owner", ""))
        started = _started(pid) if previous.get("host") == _host() and pid != os.getpid() else None
        if started is not None and started == previous.get("started"):
            raise ConfigError(
                f"run_dir {self.run_dir} is in use: process {pid} still runs it ({self.run_dir / RECORD}); "
                "stop that run first, or set run_dir=... to another directory"
            )
        servers = sorted({*previous.get("servers", []), *self.servers})
        if not owner or not servers:
            return
        closed = asyncio.run(_close_owned(servers, owner))
        if closed:
            print(
                f"closed {plural(closed, 'session')} the run left open on {', '.join(servers)} "
                f"(owner {owner}: its process {pid} is gone)"
            )

    async def close(self, pool: Any) -> None:
        """In the event loop, on every exit path: close the sessions ``pool`` still holds (a `RemoteEnvPool`;
        another pool holds none elsewhere). Bounded: a server that does not answer is left to `release`."""
        if not isinstance(pool, RemoteEnvPool):
            return
        try:
            await asyncio.wait_for(pool.close_sessions(), CLOSE_TIMEOUT_S)
            self.closed = True
        except TimeoutError:
            note(f"env servers did not close the run's sessions in {CLOSE_TIMEOUT_S:g}s; closing them by owner")

    def release(self) -> None:
        """After the event loop, on every exit path: close by owner what the loop did not close (its close was
        cut off, or never ran), then remove the record: nothing is held any more."""
        if not self.closed and self.servers:
            asyncio.run(_close_owned(self.servers, self.owner))
        (self.run_dir / RECORD).unlink(missing_ok=True)


async def close_in_loop(
    agents: Iterable[Any], sessions: RunSessions, backend: EnvBackend, engines: Iterable[InferenceEngine]
) -> None:
    """The end of the run's event loop, on every exit path: its agents, its sessions on env servers it did
    not start, the env pool (and the env server it launched), the engines; each whatever the others raise."""
    async with AsyncExitStack() as stack:  # the last pushed runs first
        for engine in engines:
            stack.push_async_callback(engine.aclose)
        stack.push_async_callback(backend.aclose)
        stack.push_async_callback(sessions.close, backend.pool)
        for agent in agents:
            stack.push_async_callback(agent.aclose)


def stop_after_loop(policies: Iterable[TrainablePolicy], launcher: Launcher, sessions: RunSessions) -> None:
    """After the event loop, on every exit path: each policy's trainer processes and engine servers, what the
    launcher started (Ray actors, a local cluster), the sessions the loop did not close; each whatever the
    others raise."""
    with ExitStack() as stack:  # the last pushed runs first
        stack.callback(sessions.release)
        stack.callback(launcher.shutdown)
        for policy in policies:
            stack.callback(policy.close)


async def _close_owned(servers: list[str], owner: str) -> int:
    """Close ``owner``'s sessions on ``servers`` (how many closed; 0 where a server does not answer in time)."""
    try:
        return int(await asyncio.wait_for(close_owned(servers, owner), CLOSE_TIMEOUT_S) or 0)
    except TimeoutError:
        note(f"env servers {', '.join(servers)} did not answer in {CLOSE_TIMEOUT_S:g}s: owner {owner}'s sessions left")
        return 0


def _host() -> str:
    return socket.gethostname()


def _started(pid: int) -> str | None:
    """When process ``pid`` started, as the kernel counts (None if it does not run): with the pid, it names a
    process (pids are reused). A zombie (exited, not yet reaped) does not run."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # none, or torn by a kill while written: nothing to go on
    return record if isinstance(record, dict) else None


def _write(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
