"""`Scheduler`: `HFEngine`'s request queue, its lock and the decode thread that serves the running batch.

Callers submit, pause, abort and close through it (under ``cv``); the decode thread takes arrivals between
steps (an idle engine waits a moment for more to arrive, a busy one holds a few back for a few steps: each
admission is a prefill), runs each step with the `BatchRunner`, stops at a step boundary while paused, and
settles the callers' futures after every step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import NamedTuple

import torch

from areal_agents.config.placement import team_threads
from areal_agents.engines.hf.batch_runner import BatchRunner, Outcome
from areal_agents.engines.hf.running_batch import RunningBatch, Submission
from areal_agents.errors import EngineError
from areal_agents.timeline import timeline

ADMISSION_MAX_WAIT_S = 0.05  # the longest an idle engine holds arriving requests back to admit them together
GATHER_FRACTION = 0.125  # a busy batch admits arrivals once they are this share of its live rows, or ...


class _Work(NamedTuple):
    """What the decode thread took from the queue for one step (under the lock)."""

    incoming: list[Submission]
    paused: bool  # only aborts to hand back; the model stays untouched
    stale: bool  # new weights since the last step: re-prefill every running row
    version: int
    flush: bool  # forget the prefix cache first
    adapters: frozenset  # LoRA adapters loaded, replaced or unloaded since the last step


class Scheduler:
    """The queue and the decode thread; the caller side and the thread share the state below ``cv`` under it
    (``runner`` is the decode thread's alone)."""

    def __init__(
        self,
        runner: BatchRunner,
        *,
        max_batch_size: int,
        admission_window_s: float,
        gather_steps: int,
        num_threads: int | None,
        version: int,
    ) -> None:
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.admission_window_s = admission_window_s
        self.gather_steps = gather_steps  # ... after this many decode steps (0: admit at every step)
        self.num_threads = num_threads
        self.version = version
        self._gathered = 0  # decode steps arrivals have been held back (decode thread only)
        self.cv = threading.Condition()  # guards everything below, shared with the decode thread
        self.incoming: list[Submission] = []
        self.running: list[Submission] = []
        self.admitting: list[Submission] = []  # taken from the queue by the step in progress
        self.beat = time.monotonic()  # when the decode thread last began or finished a step (`health`)
        self.paused = False
        self.at_boundary = True  # the decode thread is waiting, not touching the model
        self.idle = True  # ... and waiting for work: a submission must wake it
        self.stale_cache = False
        self.flush_prefixes = False
        self.changed_adapters: set[str] = set()
        self.aborts = False  # abort() marked something: hand it back even while paused
        self.closed = False
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ---- caller side ------------------------------------------------------------------------

    def submit(self, seq: Submission) -> None:
        """Queue ``seq`` for the decode thread (started by the first submission)."""
        with self.cv:
            if self.closed:
                raise EngineError("HFEngine is closed")
            if self.error is not None:
                raise EngineError(f"HFEngine decode thread failed: {self.error!r}")
            self.incoming.append(seq)
            self.runner.stats.requests += 1
            if self.thread is None:
                self.thread = threading.Thread(target=self.loop, name="hf-engine", daemon=True)
                self.thread.start()
            if self.idle:  # a busy decode thread looks at the queue every step: no wake-up (and GIL hand-off) needed
                self.cv.notify_all()

    def set_paused(self, paused: bool) -> None:
        with self.cv:
            self.paused = paused
            self.cv.notify_all()

    def wait_for_boundary(self) -> None:
        """Block until the decode thread waits between steps (or is closed or gone)."""
        with self.cv:
            while not (self.at_boundary or self.closed) and self.thread is not None and self.thread.is_alive():
                self.cv.wait(0.1)

    def new_weights(self, version: int | None, recompute: bool) -> int:
        """The model has new weights (loaded at a boundary): set the version and return it; ``recompute``:
        re-prefill."""
        with self.cv:
            self.version = self.version + 1 if version is None else version
            self.stale_cache = recompute
            self.runner.stats.weight_updates += 1
            return self.version

    def new_adapter(self, name: str, version: int | None) -> int:
        """LoRA adapter ``name`` was loaded, replaced or unloaded (at a boundary): set the version if given
        and return it; the next step forgets the adapter's cached prefixes (and recomputes running rows)."""
        with self.cv:
            if version is not None:
                self.version = version
            self.changed_adapters.add(name)
            self.runner.stats.adapter_updates += 1
            return self.version

    def abort(self, rid: str | None) -> int:
        """Mark queued and running submissions (all, or those whose rid is ``rid``) to end as ``abort``."""
        with self.cv:
            hit = [s for s in self.incoming + self.admitting + self.running if rid is None or s.rid == rid]
            for seq in hit:
                seq.abort = True
            self.aborts = bool(hit)
            self.cv.notify_all()
        return len(hit)

    def flush(self) -> None:
        with self.cv:
            self.flush_prefixes = True

    def close(self, timeout_s: float | None) -> None:
        """Stop the decode thread; with ``timeout_s``, one stuck in a step is left behind and its requests fail."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        if self.thread is None:
            return
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            with self.cv:
                stuck, self.incoming = self.incoming + self.admitting + self.running, []
            deliver([(seq, EngineError("HFEngine is closed (its decode thread did not stop)")) for seq in stuck])

    def health(self, stall_s: float) -> str | None:
        """None while the decode loop can serve; else why not (see `HFEngine.health`)."""
        with self.cv:
            if self.error is not None:
                return f"HFEngine decode thread failed: {self.error!r}"
            if self.closed:
                return "HFEngine is closed"
            if self.thread is not None and not self.thread.is_alive():
                return "HFEngine decode thread is gone"
            if not self.idle and time.monotonic() - self.beat > stall_s:
                return f"HFEngine decode thread has not finished a step for {time.monotonic() - self.beat:.0f}s"
        return None

    @property
    def num_running(self) -> int:
        with self.cv:
            return sum(not seq.future.done() for seq in self.running)

    @property
    def num_pending(self) -> int:
        with self.cv:
            queued = self.incoming + self.admitting + self.running
            return sum(not (seq.abort or seq.delivered or seq.future.done()) for seq in queued)

    # ---- decode thread ----------------------------------------------------------------------

    def loop(self) -> None:
        """The decode thread: take work, run a step (or only hand back aborts while paused), deliver."""
        # This thread's OpenMP team only; always set: a thread that never sets it takes whatever count
        # another thread of the process set last (torch keeps one process-wide value for new threads).
        torch.set_num_threads(self.num_threads or team_threads())
        runner, batch = self.runner, RunningBatch()
        tl, worker = timeline(), self._watch()
        try:
            runner.placement.bind_thread()  # the engine's GPU, if any, is this thread's current device
            runner.compile_decode()  # here: the compiled kernels take this thread's OpenMP team size
            while (work := self._take_work(batch)) is not None:
                if work.flush:
                    runner.prefixes.clear()
                if work.paused:
                    for seq in work.incoming:
                        runner.finish(seq, "abort")
                    runner.retire(batch)
                else:
                    with tl.busy(worker):
                        runner.step(batch, work.incoming, work.stale, work.version, work.adapters)
                deliver(runner.outbox)
                runner.outbox = []
                with self.cv:
                    self.running = [s for s in batch.rows if not s.delivered]
                    self.admitting, self.beat = [], time.monotonic()
        except BaseException as e:  # noqa: BLE001  (fail the requests, not silently hang them)
            self.error = e
        self._stop(batch)

    def _watch(self) -> str:
        """This engine's timeline row (busy while a step runs) and its queues: requests waiting, running."""
        tl = timeline()
        worker = tl.unique("engine/hf")
        tl.idle(worker)
        tl.gauge(f"{worker}/waiting", lambda: len(self.incoming))
        tl.gauge(f"{worker}/running", lambda: len(self.running) + len(self.admitting))
        return worker

    def _take_work(self, batch: RunningBatch) -> _Work | None:
        """Wait for work (or a pause to lift), then take this step's arrivals; None once closed."""
        with self.cv:
            while not self.closed and not self.aborts and (self.paused or not (batch.rows or self.incoming)):
                self.at_boundary = self.idle = True
                self.cv.notify_all()
                self.cv.wait()
            self.idle, self.beat = False, time.monotonic()
            if self.closed:
                return None
            if not batch.rows:
                self.await_arrivals()
            aborts, self.aborts = self.aborts, False
            if self.paused:  # only aborts to hand back; the model stays untouched
                incoming = [s for s in self.incoming if s.abort]
                self.incoming = [s for s in self.incoming if not s.abort]
            else:
                self.at_boundary = False
                room = 0 if self.gathering(batch, aborts) else self.max_batch_size - len(batch.rows)
                incoming, self.incoming = self.incoming[:room], self.incoming[room:]
            stale, self.stale_cache = (False, self.stale_cache) if self.paused else (self.stale_cache, False)
            self.admitting = incoming
            flush, self.flush_prefixes = self.flush_prefixes, False
            adapters = frozenset()
            if not self.paused:
                adapters, self.changed_adapters = frozenset(self.changed_adapters), set()
            return _Work(incoming, self.paused, stale, self.version, flush, adapters)

    def _stop(self, batch: RunningBatch) -> None:
        """The loop ended (closed, or an error): every request this engine took is answered."""
        with self.cv:
            self.at_boundary = True
            leftover = batch.rows + self.admitting + self.incoming
            self.incoming, self.running, self.admitting = [], [], []
            self.cv.notify_all()
        error = EngineError(f"HFEngine stopped: {self.error!r}" if self.error else "HFEngine is closed")
        deliver(self.runner.outbox + [(seq, error) for seq in leftover])
        self.runner.outbox = []

    def await_arrivals(self) -> None:
        """Idle engine, requests arriving: admit them together once they stop coming (a gap of
        ``admission_window_s``, at most `ADMISSION_MAX_WAIT_S`). One prefill then serves a whole
        batch of episodes, instead of many small ones fighting the submitting thread for the GIL."""
        deadline = time.perf_counter() + ADMISSION_MAX_WAIT_S
        seen = -1
        while seen != len(self.incoming) < self.max_batch_size and not (self.paused or self.closed or self.aborts):
            seen = len(self.incoming)
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or self.admission_window_s <= 0:
                return
            self.cv.wait(min(self.admission_window_s, remaining))

    def gathering(self, batch: RunningBatch, aborts: bool) -> bool:
        """Hold a few arrivals back while a busy batch decodes: every admission is a prefill pass of its own,
        whose fixed cost the whole batch waits for, so fewer, larger admissions cost less (multi-turn
        episodes send their next turns one by one)."""
        live = sum(not s.delivered for s in batch.rows) if self.incoming and not aborts else 0
        if live and len(self.incoming) < GATHER_FRACTION * live and self._gathered < self.gather_steps:
            self._gathered += 1
            return True
        self._gathered = 0
        return False


def deliver(results: list[Outcome]) -> None:
    """Settle the callers' futures: one wake-up of each caller's event loop for the lot."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}
    for seq, result in results:
        by_loop.setdefault(seq.future.get_loop(), []).append((seq, result))

    def settle(items: list[Outcome]) -> None:
        for seq, result in items:
            if seq.future.done():
                continue
            if isinstance(result, BaseException):
                seq.future.set_exception(result)
            else:
                seq.future.set_result(result)

    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(settle, items)
        except RuntimeError:  # the caller's event loop is gone: nobody is waiting
            pass
