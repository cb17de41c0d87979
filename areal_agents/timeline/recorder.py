"""`Timeline`: one process's record of when each of its workers was busy, how deep its queues were, and what
happened when (spans), written as JSONL to ``RUN/timeline/PROCESS.PID.jsonl`` for the heatmap, the trace, the
dashboard and the bottleneck report (`areal_agents.timeline.reader` reads a run's files back).

Busy time and gauges go into bins of ``dt`` seconds on the wall clock (bin ``k`` covers ``[k*dt, (k+1)*dt)``,
so every process's bins line up); a thread samples the gauges once a bin and writes the finished bins once a
second. The file is bounded: spans stop at half of ``max_bytes`` (counted as dropped; ``keep=True`` spans,
the few per step, still go in), and each time the file passes ``max_bytes`` the bins double in width and the
budget grows by half, so a run of any length writes a few budgets at most.

Example::

    tl = open_timeline(run_dir, "driver")  # this process's; `timeline()` finds it anywhere
    with tl.busy("trainer/default"):        # the worker is busy in here (nested or concurrent: busy while any)
        ...
    tl.gauge("rollout/queued_groups", lambda: controller.queued_groups)
    with tl.span("driver", "update", step=3, keep=True):
        ...
"""

from __future__ import annotations

import atexit
import json
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

DIR_ENV = "AREAL_TIMELINE_DIR"  # child processes of a run record into the run's timeline when this is set
OPTIONS_ENV = "AREAL_TIMELINE_OPTIONS"  # ... with the run's bin width and budget: "DT,MAX_BYTES"
DEFAULT_DT = 0.1
DEFAULT_MAX_BYTES = 64 << 20
# the episode the running task works for (`EpisodeRunner.run` sets it): its spans name it, wherever recorded
EPISODE: ContextVar[str | None] = ContextVar("areal_timeline_episode", default=None)


class Timeline:
    """The recorder of one process (see the module docstring). Thread-safe; `close` writes what is left."""

    def __init__(
        self,
        directory: str | Path,
        process: str,
        *,
        dt: float = DEFAULT_DT,
        max_bytes: int = DEFAULT_MAX_BYTES,
        flush_every: float = 1.0,
    ) -> None:
        if dt <= 0 or max_bytes <= 0:
            raise ValueError(f"Timeline: dt and max_bytes must be > 0, got dt={dt}, max_bytes={max_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = process
        self.path = self.directory / f"{_safe(process)}.{os.getpid()}.jsonl"
        self.dt, self.max_bytes, self.flush_every = dt, max_bytes, flush_every
        self._lock = threading.Lock()  # the bins, gauges and spans held
        self._io_lock = threading.Lock()  # the file: one flush at a time (the sampler's, a caller's, close's)
        self._active: dict[str, int] = defaultdict(int)  # worker -> callers inside `busy`
        self._since: dict[str, float] = {}  # worker -> when its current busy stretch was last counted from
        self._busy: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))  # seconds per bin
        self._gauges: dict[str, Callable[[], float]] = {}
        self._fractions: dict[str, Callable[[], float]] = {}  # workers whose busy share is read, not timed
        self._samples: dict[str, dict[int, float]] = defaultdict(dict)  # gauge -> bin -> value (last sample)
        self._spans: list[tuple[str, str, float, float, dict[str, Any]]] = []  # written by the next flush
        self._names: dict[str, int] = defaultdict(int)  # `unique`'s counts
        self.dropped_spans = 0
        self._dropped_written = 0
        self._written = 0
        self._file = self.path.open("a", encoding="utf-8")
        self._write_line({"k": "meta", "process": process, "pid": os.getpid(), "start": time.time(), "dt": dt})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, name=f"timeline-{process}", daemon=True)
        self._thread.start()

    # -- what workers call -------------------------------------------------------------------------------

    @contextmanager
    def busy(self, worker: str) -> Iterator[None]:
        """``worker`` is busy inside the block (several callers at once: busy while any is inside)."""
        self.enter(worker)
        try:
            yield
        finally:
            self.leave(worker)

    def enter(self, worker: str) -> None:
        """``worker`` starts being busy (a `busy` block's start, for code that cannot use a block)."""
        now = time.time()
        with self._lock:
            if self._active[worker] == 0:
                self._since[worker] = now
            self._active[worker] += 1

    def leave(self, worker: str) -> None:
        """A busy stretch started by `enter` ends."""
        now = time.time()
        with self._lock:
            if self._active[worker] <= 0:
                return
            self._active[worker] -= 1
            if self._active[worker] == 0:
                self._add_busy(worker, self._since.pop(worker), now)

    def unique(self, name: str) -> str:
        """``name`` the first time this timeline is asked for it, then ``name-1``, ``name-2``, ...: rows of
        several workers of one kind in a process (two policies' engines)."""
        with self._lock:
            n = self._names[name]
            self._names[name] += 1
        return name if n == 0 else f"{name}-{n}"

    def idle(self, worker: str) -> None:
        """List ``worker`` from now on, busy or not, so an idle worker still has a row in the heatmap."""
        with self._lock:
            self._busy[worker]  # noqa: B018  (defaultdict: the row exists)

    def gauge(self, name: str, read: Callable[[], float]) -> None:
        """Sample ``read()`` (a queue's depth, requests in flight) once a bin as series ``name``."""
        with self._lock:
            self._gauges[name] = read

    def busy_fraction(self, worker: str, read: Callable[[], float]) -> None:
        """``worker``'s busy share (0..1) is ``read()`` each bin: a GPU's utilisation, a served engine's."""
        with self._lock:
            self._fractions[worker] = read

    def forget(self, name: str) -> None:
        """Stop sampling gauge or fraction ``name`` (its source is gone)."""
        with self._lock:
            self._gauges.pop(name, None)
            self._fractions.pop(name, None)

    @contextmanager
    def span(self, track: str, name: str, *, keep: bool = False, **args: Any) -> Iterator[dict[str, Any]]:
        """An event on ``track`` from the block's start to its end, for the trace; ``args`` (and what the block
        adds to the dict it gets) go with it. ``keep``: never dropped for size (a step's few big events)."""
        start = time.time()
        try:
            yield args
        finally:
            self.add_span(track, name, start, time.time(), keep=keep, **args)

    def add_span(self, track: str, name: str, start: float, end: float, *, keep: bool = False, **args: Any) -> None:
        """A finished event (wall-clock ``start`` and ``end``); inside an episode, its id goes with it. Kept as it
        is: the sampler thread writes it (a run makes thousands a step; the caller's thread should not encode)."""
        episode = EPISODE.get()
        if episode is not None and "episode_id" not in args:
            args["episode_id"] = episode
        with self._lock:
            if not keep and self._written >= self.max_bytes // 2:
                self.dropped_spans += 1
                return
            self._spans.append((track, name, start, end, args))

    # -- the sampler thread ------------------------------------------------------------------------------

    def _add_busy(self, worker: str, start: float, end: float) -> None:
        """Spread ``[start, end)`` over the bins it covers (the lock is held)."""
        bins, dt = self._busy[worker], self.dt
        k = math.floor(start / dt)
        while start < end:
            edge = min((k + 1) * dt, end)
            bins[k] += edge - start
            start, k = edge, k + 1

    def _sample_loop(self) -> None:
        last_flush = time.monotonic()
        while not self._stop.wait(self.dt - (time.time() % self.dt)):
            self.sample()
            if time.monotonic() - last_flush >= self.flush_every:
                self.flush()
                last_flush = time.monotonic()

    def sample(self) -> None:
        """Read every gauge and fraction into the current bin; count the open busy stretches so far."""
        now = time.time()
        with self._lock:
            gauges, fractions = list(self._gauges.items()), list(self._fractions.items())
            for worker, since in list(self._since.items()):
                self._add_busy(worker, since, now)
                self._since[worker] = now
        k = math.floor(now / self.dt)
        values = {name: _read(fn) for name, fn in gauges}
        shares = {name: _read(fn) for name, fn in fractions}
        with self._lock:
            for bins in self._busy.values():  # every listed worker has this bin: idle is 0, not missing
                bins.setdefault(k, 0.0)
            for name, v in values.items():
                if v is not None:
                    self._samples[name][k] = v
            for worker, v in shares.items():
                if v is not None:
                    self._busy[worker][k] = min(max(v, 0.0), 1.0) * self.dt

    def flush(self, final: bool = False, spans: bool = True) -> None:
        """Write the finished bins (all of them when ``final``) and, with ``spans``, the spans so far (from any
        thread; after `close`, nothing). A step's picture needs the bins now; its spans can wait for the sampler."""
        with self._io_lock:
            if not self._file.closed:
                self._flush(final, spans)

    def _flush(self, final: bool, with_spans: bool = True) -> None:
        with self._lock:
            upto = math.inf if final else math.floor(time.time() / self.dt)
            # busy time is measured, not sampled: a bin without any is idle (0); a gauge's is unknown (null)
            busy = _take_before(self._busy, upto, lambda v: round(min(v / self.dt, 1.0), 3), gap=0.0)
            gauges = _take_before(self._samples, upto, lambda v: round(v, 3), gap=None)
            spans, self._spans = (self._spans, []) if with_spans else ([], self._spans)
            dropped, dt = self.dropped_spans, self.dt
        if busy or gauges:
            self._write_line({"k": "bins", "dt": dt, "busy": busy, "gauges": gauges})
        for track, name, start, end, args in spans:
            row = {"k": "span", "track": track, "name": name, "t": round(start, 6), "d": round(max(end - start, 0), 6)}
            self._write_line(row | {"args": args} if args else row)
        if dropped != self._dropped_written:
            self._write_line({"k": "dropped", "spans": dropped})
            self._dropped_written = dropped
        self._file.flush()
        if self._written >= self.max_bytes:
            self._coarsen()

    def _coarsen(self) -> None:
        """The file passed its budget: wider bins from now on, and half a budget more."""
        with self._lock:
            self.dt *= 2
            self.max_bytes += self.max_bytes // 2
        self._write_line({"k": "meta", "process": self.process, "pid": os.getpid(), "dt": self.dt})

    def _write_line(self, row: dict[str, Any]) -> None:
        self._write(json.dumps(row, separators=(",", ":"), default=str))

    def _write(self, line: str) -> None:
        self._file.write(line + "\n")
        self._written += len(line) + 1

    def close(self) -> None:
        """Stop sampling; count the open busy stretches up to now; write everything. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()
        with self._io_lock:
            self._flush(final=True)
            self._file.close()


def _take_before(
    series: dict[str, dict[int, float]], upto: float, fmt: Callable[[float], float], gap: float | None
) -> dict[str, list[Any]]:
    """Remove and return each series' bins before ``upto`` as ``[first_bin, [value, ...]]``, a bin that has no
    value in between as ``gap``."""
    out: dict[str, list[Any]] = {}
    for name, bins in series.items():
        done = sorted(k for k in bins if k < upto)
        if done:
            values = {k: fmt(bins.pop(k)) for k in done}
            out[name] = [done[0], [values.get(k, gap) for k in range(done[0], done[-1] + 1)]]
    return out


def _read(fn: Callable[[], float]) -> float | None:
    """A sampled value, or None when the source cannot say (a server gone, NVML failing): a gap, not a crash."""
    try:
        value = float(fn())
    except Exception:  # noqa: BLE001  (a sampler must not take the run down over one reading)
        return None
    return value if math.isfinite(value) else None


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name) or "process"


class NullTimeline:
    """The timeline of a process that records none: every call does nothing, cheaply."""

    dropped_spans = 0
    dt = DEFAULT_DT

    @contextmanager
    def busy(self, worker: str) -> Iterator[None]:
        yield

    @contextmanager
    def span(self, track: str, name: str, *, keep: bool = False, **args: Any) -> Iterator[dict[str, Any]]:
        yield args

    def unique(self, name: str) -> str:
        return name

    def enter(self, worker: str) -> None: ...
    def leave(self, worker: str) -> None: ...
    def flush(self, final: bool = False, spans: bool = True) -> None: ...
    def idle(self, worker: str) -> None: ...
    def gauge(self, name: str, read: Callable[[], float]) -> None: ...
    def busy_fraction(self, worker: str, read: Callable[[], float]) -> None: ...
    def forget(self, name: str) -> None: ...
    def add_span(self, track: str, name: str, start: float, end: float, *, keep: bool = False, **args: Any) -> None: ...
    def close(self) -> None: ...


@contextmanager
def in_episode(episode_id: str) -> Iterator[None]:
    """The spans recorded in the block (in this task) name episode ``episode_id`` (`EPISODE`)."""
    token = EPISODE.set(episode_id)
    try:
        yield
    finally:
        EPISODE.reset(token)


NULL = NullTimeline()
_current: Timeline | NullTimeline = NULL


def timeline() -> Timeline | NullTimeline:
    """This process's timeline (`NULL` when it records none)."""
    return _current


def open_timeline(
    run_dir: str | Path, process: str, *, dt: float = DEFAULT_DT, max_bytes: int = DEFAULT_MAX_BYTES
) -> Timeline:
    """Record this process into ``run_dir/timeline/`` as ``process`` (closing any timeline it had), and let the
    processes it starts from now on record there too, with the same options (`DIR_ENV`, `OPTIONS_ENV`)."""
    global _current
    directory = Path(run_dir) / "timeline"
    _current.close()
    _current = Timeline(directory, process, dt=dt, max_bytes=max_bytes)
    os.environ[DIR_ENV] = str(directory)
    os.environ[OPTIONS_ENV] = f"{dt},{max_bytes}"
    return _current


def timeline_from_env(process: str) -> Timeline | NullTimeline:
    """In a process a run started: record as ``process`` into the run's timeline when `DIR_ENV` names one."""
    global _current
    directory = os.environ.get(DIR_ENV)
    if directory and isinstance(_current, NullTimeline):
        dt, max_bytes = os.environ.get(OPTIONS_ENV, f"{DEFAULT_DT},{DEFAULT_MAX_BYTES}").split(",")
        _current = Timeline(directory, process, dt=float(dt), max_bytes=int(max_bytes))
        atexit.register(close_timeline)  # the last second's bins, also when the process ends normally
    return _current


def close_timeline() -> None:
    """Write what is left and record nothing more in this process (nor in the processes it starts)."""
    global _current
    _current.close()
    _current = NULL
    os.environ.pop(DIR_ENV, None)
    os.environ.pop(OPTIONS_ENV, None)
