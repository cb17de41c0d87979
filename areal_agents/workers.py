"""`WorkerPool`: run picklable calls in worker processes with a per-call timeout.

One bad call cannot hurt the others: a call that overruns its timeout has its worker killed and
replaced, and a worker that dies fails only the call it was running. Used for CPU-heavy env steps and,
later, reward verification.

    pool = WorkerPool(workers=2)
    result = await pool.call(math.factorial, 20, timeout=5.0)
    await pool.aclose()

Workers are spawned (no inherited threads or locks), so, as with any spawn-based multiprocessing, the
main program must be importable: a script file, a module or a notebook, not ``python - <<EOF``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from areal_agents.errors import ArealAgentsError


class CallTimeout(ArealAgentsError):
    """A call ran past its timeout; its worker was killed and replaced."""


class WorkerDied(ArealAgentsError):
    """The worker process running a call died (crash, OOM kill, os._exit)."""


class RemoteError(ArealAgentsError):
    """The call raised in the worker; the message carries the worker's exception and traceback tail."""

    def __init__(self, type_name: str, message: str, tb: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.remote_traceback = type_name, tb


STARTUP_TIMEOUT_S = 300.0  # a new worker's start-up (interpreter, imports, initializer) is not a call's time


def start_child(
    target: Callable[..., Any], args: tuple, name: str, error: type[Exception], what: str, timeout: float = 600.0
) -> tuple[Any, Connection, Any]:
    """Spawn ``target(conn, *args)`` and wait for its first message: ``("ok", value)``, returned with the
    process and this end of the pipe, or ``("error", traceback)``, raised as ``error("what: ...")``."""
    process, conn = spawn_child(target, args, name)
    status, value = first_answer(process, conn, timeout)
    if status == "error":
        stop_child(process, conn, None, timeout=0)
        raise error(f"{what}:\n{value}")
    return process, conn, value


def spawn_child(target: Callable[..., Any], args: tuple, name: str) -> tuple[Any, Connection]:
    """A spawned daemon process running ``target(conn, *args)``, and this end of its pipe."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
    process.start()
    child.close()
    return process, conn


def first_answer(process: Any, conn: Connection, timeout: float) -> tuple[str, Any]:
    """A child's first message, ``(status, value)``; ``("error", why)`` if it sends none in ``timeout`` s
    or exits first."""
    try:
        if not conn.poll(timeout):
            return "error", f"no answer in {timeout:.0f}s"
        return conn.recv()
    except EOFError:
        process.join(5)
        return "error", f"the process exited (code {process.exitcode})"


def stop_child(process: Any, conn: Connection, close_message: Any, timeout: float = 30.0) -> None:
    """Send ``close_message`` to a child process serving ``conn`` and wait ``timeout`` s for it to exit;
    kill it if it has not (stuck, or mid-way through a long call). Closes ``conn``."""
    if process.is_alive():
        try:
            conn.send(close_message)
        except (BrokenPipeError, ConnectionError, OSError):
            pass  # already gone
        process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()


def _worker_main(conn: Connection, initializer: Callable[[], Any] | None) -> None:
    if initializer is not None:
        initializer()
    conn.send(("ready", None))
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException as e:  # report everything; the worker itself keeps serving
            conn.send(("error", (type(e).__name__, str(e), traceback.format_exc(limit=4))))


@dataclass
class _Worker:
    process: mp.process.BaseProcess
    conn: Connection
    ready: bool = False


@dataclass
class WorkerPoolStats:
    calls: int = 0
    timeouts: int = 0
    deaths: int = 0
    errors: int = 0
    restarts: int = 0


class WorkerPool:
    """``workers`` processes (spawned, so no threads or locks are inherited) serving one call at a time."""

    def __init__(self, workers: int = 2, context: str = "spawn", initializer: Callable[[], Any] | None = None) -> None:
        """``initializer`` runs once in each new worker (e.g. heavy imports), replacements included."""
        if workers < 1:
            raise ValueError(f"Expects workers >= 1, got {workers}")
        self._ctx = mp.get_context(context)
        self._initializer = initializer
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="worker-pool")
        self._closed = False
        self.stats = WorkerPoolStats()
        for _ in range(workers):
            self._idle.put(self._spawn())

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(child, self._initializer), daemon=True)
        process.start()
        child.close()
        worker = _Worker(process, parent)
        with self._lock:
            self._all.append(worker)
        return worker

    def _retire(self, worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()
        with self._lock:
            self._all.remove(worker)
        if not self._closed:
            self.stats.restarts += 1
            self._idle.put(self._spawn())

    def _roundtrip(self, fn: Callable, args: tuple, kwargs: dict, timeout: float | None) -> Any:
        worker = self._idle.get()
        try:
            if not worker.ready:  # wait out its start-up first, so a call's timeout measures the call alone
                if not worker.conn.poll(STARTUP_TIMEOUT_S):
                    raise EOFError
                worker.conn.recv()
                worker.ready = True
            worker.conn.send((fn, args, kwargs))
            if not worker.conn.poll(timeout):
                self.stats.timeouts += 1
                self._retire(worker)
                worker = None
                raise CallTimeout(f"call to {getattr(fn, '__qualname__', fn)} exceeded its {timeout}s timeout")
            status, payload = worker.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            self.stats.deaths += 1
            code = worker.process.exitcode if worker else None
            if worker is not None:
                self._retire(worker)
                worker = None
            raise WorkerDied(f"worker process died during a call (exit code {code})") from None
        finally:
            if worker is not None:
                self._idle.put(worker)
        if status == "error":
            self.stats.errors += 1
            raise RemoteError(*payload)
        return payload

    def call_sync(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """The blocking form of `call`, for sync code (e.g. a gymnasium env's step); thread-safe."""
        if self._closed:
            raise ArealAgentsError("WorkerPool is closed")
        self.stats.calls += 1
        return self._roundtrip(fn, args, kwargs, timeout)

    async def call(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` in a worker; raise `CallTimeout`, `WorkerDied` or `RemoteError`."""
        if self._closed:
            raise ArealAgentsError("WorkerPool is closed")
        self.stats.calls += 1
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self._roundtrip, fn, args, kwargs, timeout)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers = list(self._all)
        for w in workers:
            w.process.kill()
            w.process.join(timeout=5)
            w.conn.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [w.process.pid for w in self._all if w.process.pid is not None]


_shared: dict[str, tuple[int, WorkerPool]] = {}  # name -> (the pid that started it, the pool)
_shared_lock = threading.Lock()


def shared_pool(name: str, workers: int, initializer: Callable[[], Any] | None = None) -> WorkerPool:
    """The process-wide pool ``name``, started on first use and again in a forked child (whose copy of
    the parent's pool has no live workers): one pool per purpose, shared by every caller."""
    with _shared_lock:
        pid, pool = _shared.get(name, (0, None))
        if pool is None or pid != os.getpid():
            pool = WorkerPool(workers, initializer=initializer)
            _shared[name] = (os.getpid(), pool)
        return pool


def may_start_processes() -> bool:
    """Whether this process may start worker processes (a daemonic one, e.g. a pool worker, may not)."""
    return not mp.current_process().daemon
