"""A run's TensorBoard scalars as JSON-ready series, re-read while the run writes them.

One `EventAccumulator` per run reads its ``tensorboard/`` event files incrementally: a reload reads only what
was appended since the last one, and reloads come at most every ``min_interval`` seconds however many
browsers poll.

    reader = ScalarReader(Path("runs/arith/rl"))
    reader.series()["rollout/reward_mean"]   # {"steps": [1, 2, ...], "values": [0.12, 0.19, ...]}
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any


def finite(value: float) -> float | None:
    """``value``, or None for NaN and infinities (JSON has no such numbers)."""
    return value if math.isfinite(value) else None


class ScalarReader:
    """Every scalar tag of one run; `series` reloads when ``min_interval`` seconds have passed."""

    def __init__(self, run_dir: Path, min_interval: float = 2.0) -> None:
        self.folder = run_dir / "tensorboard"
        self.min_interval = min_interval
        self._lock = threading.Lock()
        self._accumulator: Any = None  # made once the folder exists: a run may not have written it yet
        self._loaded_at = -math.inf
        self._series: dict[str, dict[str, list]] = {}

    def series(self) -> dict[str, dict[str, list]]:
        """Tag -> ``{"steps": [...], "values": [...]}`` (non-finite values as None), fresh within the interval."""
        with self._lock:
            if time.monotonic() - self._loaded_at >= self.min_interval:
                self._reload()
            return self._series

    def _reload(self) -> None:
        self._loaded_at = time.monotonic()
        if self._accumulator is None:
            if not self.folder.is_dir():
                return
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

            self._accumulator = EventAccumulator(str(self.folder), size_guidance={"scalars": 0})
        acc = self._accumulator
        try:
            acc.Reload()
        except Exception:  # noqa: BLE001  (a corrupt event file: keep the series read so far, never a 5xx)
            return
        series = {}
        for tag in acc.Tags().get("scalars", []):
            events = _last_per_step(acc.Scalars(tag))
            series[tag] = {"steps": [e.step for e in events], "values": [finite(e.value) for e in events]}
        self._series = series


def _last_per_step(events: list) -> list:
    """One event per step, the last written (a resumed run logs again the steps after its checkpoint)."""
    by_step = {e.step: e for e in events}
    return [by_step[s] for s in sorted(by_step)]
