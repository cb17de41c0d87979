"""Stopping `train` by SIGINT (Ctrl-C) or SIGTERM without losing finished steps.

While the loop waits for rollouts or evaluates, a signal cancels the run's task at once: the step in
progress is abandoned (nothing of it was trained on) and the recipe checkpoints the last finished step.
While a step trains and pushes its weights (between `Interrupt.hold` and `Interrupt.release`), cancelling
would leave half an update in the model, so the signal waits for the step's end and that step is kept
too. A second signal stops at once, without a checkpoint. `Interrupt.run` then ends the process as the
signal asks: ``KeyboardInterrupt`` for SIGINT (the CLI's exit 130), ``SystemExit(143)`` for SIGTERM.

Outside the event loop (loading models, launching servers) SIGTERM raises ``SystemExit(143)`` like
SIGINT's ``KeyboardInterrupt``, so launched servers are stopped either way. While the run stops what it
started (`Interrupt.stopping`: its sessions on env servers, its servers and processes), a signal is held
until that is done, then acted on: no stop is cut short, nothing is left behind.

Example::

    async def train(interrupt):
        interrupt.on_stop = save_the_last_finished_step  # async; awaited by `stop`
        try:
            ...  # each step: rollouts; hold(); update, push, log; release()
        except asyncio.CancelledError:
            if not interrupt.caught():
                raise
            await interrupt.stop()

    with Interrupt() as interrupt:
        interrupt.run(train(interrupt))
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

from areal_agents.progress import close_bars, note

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """Training stopped by ``signum`` (after the recipe saved what it could)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class Interrupt:
    """The signal state of one training run (see the module docstring)."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self.forced = False  # a second signal: stop now, save nothing
        self._task: asyncio.Task | None = None
        self._holding = False
        self._cancelled = False  # the task was cancelled (not only flagged while held)
        self._previous: Any = None  # SIGTERM's handler before `__enter__`
        self._in_loop = False  # the loop's handlers route signals to `_on_signal` (`_installed`)
        self._stopping = False  # in `stopping`: a signal is held, not acted on
        self._held: int | None = None  # the signal that came while stopping
        self.on_stop: Callable[[], Awaitable[None]] | None = None  # saves the last finished step (the recipe's)

    @property
    def name(self) -> str:
        """The first signal's name (``SIGINT``), or "" before one."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, _exit_by_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def run(self, main: Coroutine[Any, Any, Any]) -> Any:
        """``asyncio.run(main)`` with SIGINT and SIGTERM handled as described; a run they stopped ends in
        ``KeyboardInterrupt`` (SIGINT) or ``SystemExit(128 + signum)``."""
        try:
            return asyncio.run(self._main(main))
        except (Interrupted, asyncio.CancelledError):
            if self.signum is None:
                raise
            if self.signum == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise SystemExit(128 + self.signum) from None

    async def _main(self, main: Coroutine[Any, Any, Any]) -> Any:
        with self._installed():
            return await main

    @contextmanager
    def _installed(self) -> Iterator[None]:
        """Route SIGINT and SIGTERM to `_on_signal` while the run's task runs (main thread only: elsewhere
        signals keep their handlers)."""
        loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        installed = []
        # asyncio takes signal handlers on Unix event loops, in the main thread only
        if threading.current_thread() is threading.main_thread() and sys.platform != "win32":
            for signum in SIGNALS:
                installed.append((signum, signal.getsignal(signum)))
                loop.add_signal_handler(signum, self._on_signal, signum)
        self._in_loop = True
        try:
            yield
        finally:
            self._in_loop = False
            for signum, previous in installed:
                loop.remove_signal_handler(signum)
                signal.signal(signum, previous)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._stopping:
            self._hold(signum)
            return
        if self.signum is not None:
            if not self.forced:
                note(f"{name} again: stopping now, without a checkpoint")
            self.forced = True
            self._cancel()
            return
        self.signum = signum
        if self._holding:
            note(f"{name}: finishing this step's update, then saving a checkpoint ({name} again stops now)")
            return
        self._cancel()

    def _cancel(self) -> None:
        if self._task is not None:
            self._cancelled = True
            self._task.cancel()

    def hold(self) -> None:
        """The step trains from here: a signal waits for `release`."""
        self._holding = True

    def release(self) -> None:
        """The step is finished (trained, pushed, logged); act on a signal that came while held."""
        self._holding = False
        if self.signum is not None:
            raise asyncio.CancelledError

    @contextmanager
    def stopping(self) -> Iterator[None]:
        """Stop what the run started (in the event loop, or after `run`) with SIGINT and SIGTERM held: one
        that comes meanwhile is noted and acted on at the block's end (in the loop: `Interrupted`; after:
        ``KeyboardInterrupt`` or ``SystemExit(128 + signum)``, as `run`), unless the block ends in an
        exception already (the run is ending anyway). Outside the loop, in the main thread only."""
        installed = []
        if not self._in_loop and threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                installed.append((signum, signal.signal(signum, lambda n, _: self._hold(n))))
        self._stopping, self._held = True, None
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            self._stopping = False
            for signum, previous in installed:
                signal.signal(signum, previous)
            held = self._held
            if held is not None and not failed:
                if self.signum is None:
                    self.signum = held
                if self._in_loop:
                    raise Interrupted(held)
                if held == signal.SIGINT:
                    raise KeyboardInterrupt
                raise SystemExit(128 + held)

    def _hold(self, signum: int) -> None:
        if self._held is None:
            self._held = signum
            note(f"{signal.Signals(signum).name}: stopping the run's servers, processes and sessions first")

    async def stop(self) -> None:
        """After `caught`: close the progress bars (their last lines before the stop's), run `on_stop` (unless
        a second signal forced the stop), then raise `Interrupted`."""
        close_bars()
        if self.on_stop is not None and not self.forced:
            await self.on_stop()
        raise Interrupted(self.signum)

    def caught(self) -> bool:
        """In an ``except CancelledError``: whether a signal caused it (then the task is un-cancelled, so
        the recipe can still await while it saves); False for any other cancellation."""
        if self.signum is None:
            return False
        if self._cancelled and self._task is not None:
            self._task.uncancel()
            self._cancelled = False
        return True


def _exit_by_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
