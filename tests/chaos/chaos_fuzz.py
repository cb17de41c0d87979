"""The chaos suite's tools: seeded request fuzzing of an HTTP service, a tally by kind, RSS and shutdown.

A `Shot` is one client action (one request, or a short valid sequence such as create-step-close) that
returns ``(kind, valid, status)`` records. `fire` runs shots with bounded concurrency and time and
tallies them; the tests assert on the tally and print it, with the seed, so a failure can be replayed.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import os
import random
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

Record = tuple[str, bool, int]  # kind, valid (must succeed), HTTP status (0: no answer)
SUMMARIES: list[str] = []  # one line per chaos test, printed at the end of the run (tests/chaos/conftest.py)


def report(line: str) -> None:
    """Print a chaos test's summary and keep it for the run's closing section (seen in CI logs too)."""
    print(line)
    SUMMARIES.append(line)


Shot = Callable[[aiohttp.ClientSession, str], Awaitable[list[Record]]]


@dataclass
class Tally:
    """Requests by kind, and what went wrong: valid ones that failed, client errors answered 5xx."""

    sent: Counter = field(default_factory=Counter)
    valid_failed: list[str] = field(default_factory=list)
    server_errors: list[str] = field(default_factory=list)

    def add(self, records: list[Record]) -> None:
        for kind, valid, status in records:
            self.sent[kind] += 1
            if valid and not 200 <= status < 300:
                self.valid_failed.append(f"{kind}: {status}")
            if not valid and (status >= 500 or status == 0):
                self.server_errors.append(f"{kind}: {status}")

    def summary(self, name: str, seed: int) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.sent.items()))
        return (
            f"chaos {name} (seed {seed}): {sum(self.sent.values())} requests ({kinds}); "
            f"5xx for client errors: {len(self.server_errors)}; valid failed: {len(self.valid_failed)}"
        )


async def request(
    session: aiohttp.ClientSession, method: str, url: str, *, body: Any = None, raw: bytes | None = None, **kw: Any
) -> tuple[int, Any]:
    """One request: the status (0 when the server did not answer) and the decoded body."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    try:
        async with session.request(method, url, data=data, headers=headers, **kw) as r:
            text = await r.text(errors="replace")
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text
    except (TimeoutError, aiohttp.ClientError):
        return 0, None


def single(kind: str, method: str, path: str, valid: bool = False, **kw: Any) -> Shot:
    """A shot of one request."""

    async def shot(session: aiohttp.ClientSession, base: str) -> list[Record]:
        status, _ = await request(session, method, base + path, **kw)
        return [(kind, valid, status)]

    return shot


async def fire(base: str, shots: list[Shot], *, concurrency: int = 16, timeout_s: float = 30.0) -> Tally:
    """Run ``shots`` against ``base`` with at most ``concurrency`` at once; each request within ``timeout_s``."""
    tally, gate = Tally(), asyncio.Semaphore(concurrency)
    client_timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=client_timeout) as session:

        async def run(shot: Shot) -> None:
            async with gate:
                tally.add(await shot(session, base))

        await asyncio.gather(*(run(s) for s in shots))
    return tally


def mix(rng: random.Random, valid: list[Shot], malformed: list[Shot], n: int, valid_share: float = 0.25) -> list[Shot]:
    """``n`` shots, valid ones interleaved with malformed ones at random (seeded)."""
    return [rng.choice(valid) if rng.random() < valid_share else rng.choice(malformed) for _ in range(n)]


def junk(rng: random.Random) -> Any:
    """A random JSON value of a random type: what a confused or hostile client sends."""
    return rng.choice(
        [None, True, -1, 0, 2**63, -(2**70), 1.5e308, float("-0.0"), "", "x" * rng.randint(1, 5000), [], [None], {}]
    )


def own_rss_kb() -> int:
    """This process's resident memory in KiB once freed memory is given back: collected, and glibc's free
    arenas trimmed (what a burst of 9 MiB bodies leaves in malloc's arenas is not a leak)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_kb(os.getpid())


def rss_kb(pid: int) -> int:
    """Resident memory of process ``pid`` in KiB (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def start_server(args: list[str], health_url: str, timeout_s: float = 120.0) -> subprocess.Popen:
    """Start a server subprocess (its own process group) and wait for ``health_url`` to answer 200. Its
    stderr goes to a file: a pipe nobody reads fills up and blocks a server that logs (tracebacks, say)."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{args[3:5]} exited {proc.returncode}: {log.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(health_url, timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{args[3:5]} did not become healthy in {timeout_s} s")


def stops_on_sigterm(proc: subprocess.Popen, within_s: float = 10.0) -> bool:
    """SIGTERM the server; True when it exits within ``within_s`` (it is killed otherwise)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=within_s)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False
