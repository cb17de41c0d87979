"""Episode failures reported without flooding the log (`FailureLog`).

The first failure of each cause is logged at once and its traceback written once to a file (a run's
``failures.log``); after that a cause gets one line per interval, with its count:

    env_failed ×120 in the last 30 s: EnvError unreachable: http://127.0.0.1:8765/v1/sessions: ...

A cause is the outcome (``env_failed``, ``retried``, ...) and the error's class and kind, not its text
(texts differ by session id and address).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import Counter
from pathlib import Path

from areal_agents.errors import EnvError

log = logging.getLogger(__name__)

Cause = tuple[str, str]  # (outcome, the error's class and kind)


def error_kind(error: BaseException) -> str:
    """The error's class and, where it has one, its kind: ``EnvError unreachable``, ``RequestError``."""
    kind = error.kind if isinstance(error, EnvError) else ""
    return f"{type(error).__name__} {kind}".strip()


def error_text(error: BaseException, limit: int = 300) -> str:
    """The error's message on one line, cut to ``limit`` characters."""
    text = " ".join((error.detail if isinstance(error, EnvError) else str(error)).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class FailureLog:
    """Count failures by cause; log the first of each at once and the rest as one line per ``interval_s``.

    failures = FailureLog(run_dir / "failures.log")
    failures.record("env_failed", error, "g3/e1")
    failures.flush()  # the counts not yet logged (at the end of a run)
    """

    def __init__(
        self, traceback_file: str | Path | None = None, *, interval_s: float = 30.0, logger: logging.Logger = log
    ) -> None:
        self.traceback_file = Path(traceback_file) if traceback_file is not None else None
        self.interval_s = interval_s
        self.logger = logger
        self.totals: Counter[Cause] = Counter()  # every failure since the start, by cause
        self.last_text: dict[Cause, str] = {}  # the newest message of each cause
        self._unlogged: Counter[Cause] = Counter()  # counted since the cause's last line
        self._last_line: dict[Cause, float] = {}

    def record(self, outcome: str, error: BaseException, episode_id: str) -> None:
        """Count one failure of ``episode_id``; log it if it is the first of its cause or the interval passed."""
        cause = (outcome, error_kind(error))
        self.totals[cause] += 1
        self.last_text[cause] = error_text(error)
        now = time.monotonic()
        if cause not in self._last_line:  # the first of its cause: its traceback to the file, else to the log
            self._last_line[cause] = now
            where = self._write_traceback(cause, error, episode_id)
            line = "%s: episode %s: %s: %s%s"
            exc_info = error if self.traceback_file is None else None
            self.logger.warning(line, outcome, episode_id, cause[1], self.last_text[cause], where, exc_info=exc_info)
            return
        self._unlogged[cause] += 1
        if now - self._last_line[cause] >= self.interval_s:
            self._line(cause, now)

    def flush(self) -> None:
        """Log every count not yet logged."""
        now = time.monotonic()
        for cause in [c for c, n in self._unlogged.items() if n]:
            self._line(cause, now)

    def since(self, mark: Counter[Cause]) -> Counter[Cause]:
        """Failures by cause since ``mark`` (a copy of `totals` taken earlier)."""
        return self.totals - mark

    def describe(self, counts: Counter[Cause], top: int = 2) -> str:
        """The ``top`` most frequent failures of ``counts`` (retries left out), with their newest message."""
        counts = Counter({cause: n for cause, n in counts.items() if cause[0] != "retried"})
        parts = [
            f"{outcome} ×{n} ({kind}: {self.last_text[(outcome, kind)]})"
            for (outcome, kind), n in counts.most_common(top)
        ]
        return "; ".join(parts)

    def _line(self, cause: Cause, now: float) -> None:
        seconds = now - self._last_line[cause]
        count, self._unlogged[cause] = self._unlogged[cause], 0
        self._last_line[cause] = now
        self.logger.warning(
            "%s ×%d in the last %.0f s: %s: %s", cause[0], count, seconds, cause[1], self.last_text[cause]
        )

    def _write_traceback(self, cause: Cause, error: BaseException, episode_id: str) -> str:
        """Append the traceback of the first failure of ``cause`` to the file; where it went, for the log line."""
        if self.traceback_file is None:
            return ""
        trace = "".join(traceback.format_exception(error))
        with self.traceback_file.open("a", encoding="utf-8") as f:
            f.write(f"== {cause[0]}: {cause[1]} (first: episode {episode_id}, {time.strftime('%Y-%m-%d %H:%M:%S')})\n")
            f.write(trace + "\n")
        return f" (traceback in {self.traceback_file}; more of these are counted, not logged)"
