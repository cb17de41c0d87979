"""Progress that reads well wherever output goes: tqdm's bar on a terminal, plain lines in a log.

On a terminal ``progress_bar`` is the usual tqdm bar. When its stream is not a terminal (CI, ``nohup``, a
redirect to a file) it is a :class:`LineProgress`: a tqdm that writes one newline-terminated line at most
every ``interval`` seconds, and at once when the count reaches the total or the bar closes; never a
carriage return::

    bar = progress_bar(total=6, desc="rl")
    for step in range(1, 7):
        ...
        bar.set_postfix(reward=f"{reward:.3f}", refresh=False)
        bar.update()
    bar.close()
    # in a log file, every 30 s and at the end:
    # rl: 3/6 [00:31<00:31,  10.35s/it, reward=0.412]
    # rl: 6/6 [01:02<00:00,  10.33s/it, reward=0.530]
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import tqdm

LINE_FORMAT = "{desc}: {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
OPEN_LINE_FORMAT = "{desc}: {n_fmt} [{elapsed}, {rate_fmt}{postfix}]"  # no total: no remaining time


def progress_bar(
    iterable: Iterable[Any] | None = None,
    *,
    total: float | None = None,
    desc: str,
    enabled: bool = True,
    interval: float = 30.0,
    file: TextIO | None = None,
    **kwargs: Any,
) -> tqdm:
    """A tqdm bar on a terminal, else a :class:`LineProgress` writing a line every ``interval`` seconds.

    Use it as tqdm: iterate over it, or ``update()`` it and ``close()`` it; ``set_postfix`` values
    appear on every line. ``enabled=False`` gives a disabled bar (it prints nothing). ``file`` is the
    stream (default ``sys.stderr``); other keyword arguments (``initial``, ``unit``, ...) go to tqdm.
    """
    stream = sys.stderr if file is None else file
    if not enabled or _is_tty(stream):
        kwargs.setdefault("dynamic_ncols", True)
        return tqdm(iterable, total=total, desc=desc, disable=not enabled, file=stream, **kwargs)
    return LineProgress(iterable, total=total, desc=desc, file=stream, interval=interval, **kwargs)


def close_bars() -> None:
    """Close every open bar, so its last line comes before what is printed next (a stop's messages), not
    when the bar is collected after them."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def note(message: str) -> None:
    """Print ``message`` on stderr above any open bar (tqdm clears and redraws it around the line)."""
    tqdm.write(message, file=sys.stderr)
    sys.stderr.flush()


def plural(count: int, noun: str) -> str:
    """``"1 problem"``, ``"3 problems"``: a count and a regular noun that agrees with it."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class LineProgress(tqdm):
    """tqdm for a stream that is not a terminal: whole lines, at most one per ``interval`` seconds.

    As the count moves (``update()``, or a loop over the bar), a line is written when ``interval``
    seconds have passed since the last one or the count reached ``total``; ``close()`` writes one if the
    count moved since the last. Refreshes (``set_postfix``, ``tqdm.write``) write nothing and nothing
    is ever cleared, so a log holds only whole lines.

        bar = LineProgress(total=100, desc="eval", file=log, interval=60)
    """

    monitor_interval = 0  # no monitor thread: lines come from update() and close() only

    def __init__(self, *args: Any, interval: float = 30.0, **kwargs: Any) -> None:
        self.interval = interval
        kwargs.setdefault("mininterval", interval)  # tqdm's own refreshes (no-ops here) and rate windows
        kwargs.setdefault("miniters", 1)
        super().__init__(*args, **kwargs)
        self._line_n, self._line_t = self.n, getattr(self, "start_t", 0.0)  # the last line's count and time
        self.sp = None  # tqdm's carriage-return printer: unused, and close() then writes no bar of its own

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        """tqdm's refresh: nothing to draw, lines are written as the count moves."""
        return True

    def clear(self, nolock: bool = False) -> None:
        """Nothing to clear: a log keeps its lines."""

    def update(self, n: float | None = 1) -> bool | None:
        shown = super().update(n)
        if not self.disable:
            self._line(force=self.total is not None and self.n >= self.total)
        return shown

    def close(self) -> None:
        if not self.disable:
            self._ema_dt = lambda: None  # the last line's rate: the average over the run, as tqdm's own
            self._line(force=True)
        super().close()

    def reset(self, total: float | None = None) -> None:
        super().reset(total)
        self._line_n, self._line_t = self.n, self.start_t

    def _line(self, force: bool) -> None:
        """Write the state as one line if the count moved since the last and ``interval`` passed (or ``force``)."""
        now = self._time()
        if self.n == self._line_n or (not force and now - self._line_t < self.interval):
            return
        fmt = LINE_FORMAT if self.total is not None else OPEN_LINE_FORMAT
        line = self.format_meter(**{**self.format_dict, "bar_format": fmt, "ncols": None})
        self._line_n, self._line_t = self.n, now
        self.fp.write(line + "\n")
        self.fp.flush()
