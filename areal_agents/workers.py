"""`WorkerPool`: run picklable calls in worker processes with a per-call timeout.

One bad call cannot hurt the others: a call that overruns its timeout has its worker killed and
replaced, and a worker that dies fails only the call it was running. Used for env steps in processes,
reward scoring and math verification; `spawn_child` starts the engine and trainer processes the same way.

    pool = WorkerPool(workers=2)
    result = await pool.call(math.factorial, 20, timeout=5.0)
    await pool.aclose()

Every process started here is a fresh interpreter (as multiprocessing's ``spawn``: no inherited threads or
locks; the parent's ``sys.path`` and working directory) that never imports the caller's ``__main__``: a
script without ``if __name__ == "__main__":``, ``python -`` from stdin, ``python -c`` and a notebook all
work alike, and no worker runs the user's script again. So what a call sends must be importable from a
module: a function or class defined in ``__main__`` is refused with `WorkerImportError` before it is sent.
A worker that cannot start raises `WorkerStartError`; neither is ever turned into a result.

No process started here outlives its parent: a spawned child exits when the process that started it is
gone (killed, even by SIGKILL: `_exit_with_parent`), and `die_with_parent` does the same for a server
started with ``subprocess.Popen``.
"""

from __future__ import annotations

import asyncio
import ctypes
import io
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import context, popen_spawn_posix, reduction, spawn, util
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


class WorkerStartError(ArealAgentsError):
    """A worker process could not start (no interpreter, an import error, its initializer raised, no answer):
    raised to the caller, never taken for a call's result."""


class WorkerImportError(ArealAgentsError):
    """A call names a function or class that worker processes cannot import: one defined in ``__main__``,
    or in a module that is not importable from the caller's ``sys.path``."""


STARTUP_TIMEOUT_S = 300.0  # a new worker's start-up (interpreter, imports, initializer) is not a call's time
PARENT_POLL_S = 1.0  # how often a spawned child checks that its parent still runs
_PR_SET_PDEATHSIG = 1
# resolved here, once: the forked child of `die_with_parent` calls it before exec and must not load anything
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def die_with_parent() -> None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the kernel sends the child SIGTERM when its parent dies, a
    SIGKILL included, so a server a run started never outlives the run (Linux; elsewhere a no-op). The
    kernel ties this to the parent *thread*: start the child from a thread that lives as long as it should
    (the main thread, or one that stops it anyway when it ends)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _defined_in_main(obj: type | types.FunctionType) -> str:
    kind = "class" if isinstance(obj, type) else "function"
    return (
        f"{kind} {obj.__qualname__!r} is defined in __main__ (your script, notebook or -c code), which worker "
        "processes never import (they would run your script again): define it in a module, e.g. a .py file "
        "next to your script, and import it from there"
    )


class _MainRefusingPickler(reduction.ForkingPickler):
    """Pickles as multiprocessing does (as fast: the hook sees instances, classes and functions, not the
    built-in containers and strings), raising `WorkerImportError` at a function or class of ``__main__``."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            raise WorkerImportError(_defined_in_main(obj))
        return NotImplemented


def dumps(obj: Any) -> memoryview:
    """``obj`` pickled for a worker process, as `Connection.send` would; `WorkerImportError` if it names a
    function or class of ``__main__``."""
    file = io.BytesIO()
    _MainRefusingPickler(file).dump(obj)
    return file.getbuffer()


class _SpawnWithoutMain(popen_spawn_posix.Popen):
    """multiprocessing's ``spawn`` start (``popen_spawn_posix.Popen._launch``, as CPython 3.11 writes it) with
    one change: the child is not told to import the parent's main module, which would run a user's script
    again (or fail, from stdin). The process object is refused if it refers to ``__main__``."""

    def _launch(self, process_obj: Any) -> None:
        from multiprocessing import resource_tracker

        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        prep_data = spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_path", None)
        prep_data.pop("init_main_from_name", None)
        fp = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, fp)
            _MainRefusingPickler(fp).dump(process_obj)
        finally:
            context.set_spawning_popen(None)
        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            self._fds.extend([child_r, child_w])
            self.pid = util.spawnv_passfds(spawn.get_executable(), cmd, self._fds)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            self.finalizer = util.Finalize(self, util.close_fds, [fd for fd in (parent_r, parent_w) if fd is not None])
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)


class _Process(context.SpawnProcess):
    """A spawned process that never imports the caller's ``__main__`` (see `_SpawnWithoutMain`)."""

    @staticmethod
    def _Popen(process_obj: Any) -> _SpawnWithoutMain:  # noqa: N802  (multiprocessing's name)
        return _SpawnWithoutMain(process_obj)


def start_child(
    target: Callable[..., Any], args: tuple, name: str, error: type[Exception], what: str, timeout: float = 600.0
) -> tuple[Any, Connection, Any]:
    """Spawn ``target(conn, *args)`` and wait for its first message: ``("ok", value)``, returned with the
    process and this end of the pipe, or ``("error", traceback)``, raised as ``error("what: ...")``."""
    try:
        process, conn = spawn_child(target, args, name)
    except WorkerStartError as e:
        raise error(f"{what}: {e}") from e
    status, value = first_answer(process, conn, timeout)
    if status == "error":
        stop_child(process, conn, None, timeout=0)
        raise error(f"{what}:\n{value}")
    return process, conn, value


def spawn_child(target: Callable[..., Any], args: tuple, name: str) -> tuple[Any, Connection]:
    """A daemon process running ``target(conn, *args)`` in a fresh interpreter that never imports the
    caller's ``__main__``, and this end of its pipe. `WorkerStartError` if it cannot be started,
    `WorkerImportError` if ``target`` or ``args`` refer to ``__main__``."""
    python = os.fsdecode(spawn.get_executable())
    if not os.access(python, os.X_OK):  # spawn's exec would fail silently in the child (exit code 255)
        raise WorkerStartError(f"could not start process {name!r}: no executable interpreter at {python}")
    conn, child = mp.Pipe()
    process = _Process(target=_exit_with_parent, args=(child, os.getpid(), target, *args), name=name, daemon=True)
    try:
        process.start()
    except BaseException as e:
        conn.close()
        if isinstance(e, OSError):  # e.g. it exited before taking its start-up data
            raise WorkerStartError(f"could not start process {name!r} with {python}: {e}") from e
        raise
    finally:
        child.close()
    return process, conn


def _exit_with_parent(conn: Connection, parent: int, target: Callable[..., Any], *args: Any) -> None:
    """In a spawned child: run ``target(conn, *args)``, and exit at once if process ``parent`` goes (killed,
    even by SIGKILL): an idle child would see its pipe close, but one mid-call (a long update, a hung env
    step, a collective waiting for a dead peer) would not. Polled by pid, not by the kernel's parent-death
    signal, which fires when the parent *thread* that started the child ends (pools start workers from
    threads that come and go)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    target(conn, *args)


def first_answer(process: Any, conn: Connection, timeout: float) -> tuple[str, Any]:
    """A child's first message, ``(status, value)``; ``("error", why)`` if it sends none in ``timeout`` s
    or exits first."""
    try:
        if not conn.poll(timeout):
            return "error", f"no answer in {timeout:.0f}s"
        return conn.recv()
    except (EOFError, OSError):
        process.join(5)
        return "error", f"the process exited (code {process.exitcode}) before it answered; its stderr says why"


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


def set_intra_op_threads(threads: int) -> None:
    """This process's intra-op threads from now on: torch (OpenMP, MKL) and BLAS read the variables when they
    load, and torch, if already loaded, is told at once (for the calling thread and threads started later)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def _worker_main(conn: Connection, initializer: Callable[[], Any] | None, threads: int | None = None) -> None:
    if threads is not None:  # before the initializer's imports: a worker is one of many sharing the cores
        set_intra_op_threads(threads)
    if initializer is not None:
        try:
            initializer()
        except BaseException:  # the pool raises it as WorkerStartError
            conn.send(("error", f"its initializer raised:\n{traceback.format_exc(limit=-6)}"))
            return
    conn.send(("ready", None))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, KeyboardInterrupt):
            return
        try:
            fn, args, kwargs = reduction.ForkingPickler.loads(data)
        except BaseException as e:  # e.g. a module the worker cannot import
            conn.send(("unloadable", f"{type(e).__name__}: {e}"))
            continue
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException as e:  # report everything; the worker itself keeps serving
            conn.send(("error", (type(e).__name__, str(e), traceback.format_exc(limit=4))))


@dataclass
class _Worker:
    """One place in a pool: a worker process, or none (not started, or it failed to) until a call takes it."""

    process: Any = None
    conn: Connection | None = None
    ready: bool = False


@dataclass
class WorkerPoolStats:
    calls: int = 0
    timeouts: int = 0
    deaths: int = 0
    errors: int = 0
    restarts: int = 0
    start_failures: int = 0


class WorkerPool:
    """``workers`` processes (fresh interpreters that never import ``__main__``) serving one call at a time."""

    def __init__(
        self,
        workers: int = 2,
        initializer: Callable[[], Any] | None = None,
        name: str = "worker-pool",
        threads: int | None = None,
    ) -> None:
        """``initializer`` runs once in each new worker (e.g. heavy imports), replacements included; it must
        live in a module. ``name`` names the workers in errors and process listings. ``threads``: each
        worker's intra-op threads (torch, OpenMP, BLAS), set before its initializer; None: the libraries'
        default, every core, in each worker."""
        if workers < 1:
            raise ValueError(f"Expects workers >= 1, got {workers}")
        if threads is not None and threads < 1:
            raise ValueError(f"Expects threads >= 1 or None, got {threads}")
        self.name, self.threads = name, threads
        self._initializer = initializer
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._slots = [_Worker() for _ in range(workers)]
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._closed = False
        self.stats = WorkerPoolStats()
        try:
            for slot in self._slots:
                self._start(slot)
        except BaseException:
            self.close()
            raise
        for slot in self._slots:
            self._idle.put(slot)

    def _start(self, slot: _Worker) -> None:
        slot.process, slot.conn = spawn_child(_worker_main, (self._initializer, self.threads), self.name)
        slot.ready = False

    def _stop(self, slot: _Worker) -> None:
        if slot.process is not None:
            if slot.process.is_alive():
                slot.process.kill()
            slot.process.join(timeout=5)
            slot.conn.close()
        slot.process, slot.conn, slot.ready = None, None, False

    def _replace(self, slot: _Worker) -> None:
        """Kill the slot's worker and start another at once (its start-up overlaps the next call's wait)."""
        self._stop(slot)
        if not self._closed:
            self.stats.restarts += 1
            try:
                self._start(slot)
            except WorkerStartError:
                pass  # the next call that takes this slot tries again, and raises it

    def _ready(self, slot: _Worker) -> None:
        """Start the slot's worker if it has none and wait out its start-up (so a call's timeout measures the
        call alone); `WorkerStartError` if it cannot start."""
        if slot.process is None:
            self._start(slot)
        if slot.ready:
            return
        status, why = first_answer(slot.process, slot.conn, STARTUP_TIMEOUT_S)
        if status != "ready":
            self.stats.start_failures += 1
            self._replace(slot)
            python = os.fsdecode(spawn.get_executable())
            raise WorkerStartError(f"a {self.name} worker process ({python}) could not start: {why}")
        slot.ready = True

    def _roundtrip(self, fn: Callable, args: tuple, kwargs: dict, timeout: float | None) -> Any:
        data = dumps((fn, args, kwargs))  # WorkerImportError here, before any worker is taken
        slot = self._idle.get()
        try:
            self._ready(slot)
            try:
                slot.conn.send_bytes(data)
                if not slot.conn.poll(timeout):
                    self.stats.timeouts += 1
                    self._replace(slot)
                    raise CallTimeout(f"call to {getattr(fn, '__qualname__', fn)} exceeded its {timeout}s timeout")
                status, payload = slot.conn.recv()
            except (EOFError, OSError):
                self.stats.deaths += 1
                slot.process.join(timeout=5)
                code = slot.process.exitcode
                self._replace(slot)
                raise WorkerDied(f"worker process died during a call (exit code {code})") from None
        finally:
            self._idle.put(slot)
        if status == "unloadable":
            raise WorkerImportError(
                f"a {self.name} worker could not load the call to {getattr(fn, '__qualname__', fn)}: {payload} "
                "(workers import what a call names through the caller's sys.path; define it in a module there)"
            )
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
        """Run ``fn(*args, **kwargs)`` in a worker; raise `CallTimeout`, `WorkerDied` or `RemoteError` (what the
        call did), `WorkerStartError` or `WorkerImportError` (no worker could run it)."""
        if self._closed:
            raise ArealAgentsError("WorkerPool is closed")
        self.stats.calls += 1
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self._roundtrip, fn, args, kwargs, timeout)

    def close(self) -> None:
        self._closed = True
        for slot in self._slots:
            process, conn = slot.process, slot.conn  # a call's thread may be replacing them
            if process is not None:
                process.kill()
                process.join(timeout=5)
            if conn is not None:
                conn.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in (slot.process for slot in self._slots) if p is not None and p.pid is not None]


_shared: dict[str, tuple[int, WorkerPool]] = {}  # name -> (the pid that started it, the pool)
_shared_lock = threading.Lock()


def shared_pool(name: str, workers: int, initializer: Callable[[], Any] | None = None) -> WorkerPool:
    """The process-wide pool ``name``, started on first use and again in a forked child (whose copy of
    the parent's pool has no live workers): one pool per purpose, shared by every caller."""
    with _shared_lock:
        pid, pool = _shared.get(name, (0, None))
        if pool is None or pid != os.getpid():
            pool = WorkerPool(workers, initializer=initializer, name=name)
            _shared[name] = (os.getpid(), pool)
        return pool


def may_start_processes() -> bool:
    """Whether this process may start worker processes (a daemonic one, e.g. a pool worker, may not)."""
    return not mp.current_process().daemon
