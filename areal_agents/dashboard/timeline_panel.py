"""The workers' timeline for the dashboard: a workers x time busy heatmap, the queue and in-flight gauges at the
timeline's own resolution (100 ms bins, not one point a step), and where each step began and ended.

A `TimelineTail` follows the run's ``RUN/timeline/`` files, parsing only the lines added since its last read, at
most every ``min_interval`` seconds and only when a file changed. A run that recorded none says so:
``{"available": false, "why": ...}``.

    panel = TimelinePanel(run)
    panel.payload()    # {"available": True, "workers": [...], "busy": [[...]], "times": [...], "gauges": {...}, ...}
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np

from areal_agents.dashboard.runs import Run
from areal_agents.timeline import RunTimeline
from areal_agents.timeline.bottleneck import bottleneck_report, read_run_config
from areal_agents.timeline.heatmap import row_order
from areal_agents.timeline.tail import TimelineTail

HEATMAP_BINS = 600  # columns of the heatmap: coarser bins (means) past this
GAUGE_BINS = 3000  # points of a gauge's line


def values(v: np.ndarray) -> list[float | None]:
    """An array as a JSON list (NaN: not recorded, as None)."""
    return [float(x) if math.isfinite(x) else None for x in v.tolist()]


def gauge_group(name: str) -> str:
    """Which chart a gauge goes on: ``cores`` (cpu/...), ``memory`` (GiB), else ``queues`` (counts)."""
    if name.startswith("cpu/"):
        return "cores"
    if name.endswith("memory_gib"):
        return "memory"
    return "queues"


def steps(tl: RunTimeline) -> list[dict[str, Any]]:
    """Each training step's span on the driver: its number and its start and end, in seconds since the start."""
    out = []
    for s in tl.spans:
        if s.track == "driver" and s.name == "step" and isinstance(s.args.get("step"), int):
            out.append({"step": s.args["step"], "start": s.start - tl.start, "end": s.end - tl.start})
    return out


def payload(run: Run, tl: RunTimeline) -> dict[str, Any]:
    """What the page draws from a read timeline."""
    if not tl.bins:
        return {"available": False, "why": f"{run.name} has recorded no timeline yet (RUN/timeline/)"}
    heat, lines = tl.coarse(HEATMAP_BINS), tl.coarse(GAUGE_BINS)
    workers = row_order(list(heat.busy))  # as TensorBoard's heatmap image: engines, trainers, envs, reward, GPUs
    return {
        "available": True,
        "run": run.index,
        "dt": tl.dt,
        "heatmap_dt": heat.dt,
        "workers": workers,
        "times": values(heat.times().round(3)),
        "busy": [values(heat.busy[w]) for w in workers],
        "busy_share": {w: tl.busy_share(w) for w in tl.busy},
        "gauge_dt": lines.dt,
        "gauge_times": values(lines.times().round(3)),
        "gauges": {k: {"group": gauge_group(k), "values": values(v)} for k, v in lines.gauges.items()},
        "steps": steps(tl),
        "seconds": tl.bins * tl.dt,
        "dropped_spans": tl.dropped_spans,
        "bottleneck": bottleneck_text(run, tl),
    }


def bottleneck_text(run: Run, tl: RunTimeline) -> str | None:
    """The bottleneck report of the timeline read so far (None before a step has finished)."""
    report = bottleneck_report(tl, read_run_config(run.path))
    return "\n".join(report.lines()) if report.wall_s > 0 else None


class TimelinePanel:
    """One run's timeline, read again when its files changed and ``min_interval`` seconds have passed."""

    def __init__(self, run: Run, min_interval: float = 3.0) -> None:
        self.run = run
        self.min_interval = min_interval
        self._lock = threading.Lock()
        self._checked = -math.inf
        self._tail = TimelineTail(run.path)
        self._key: tuple = ()
        self._payload: dict[str, Any] = payload(run, RunTimeline(0.0, 0.1, {}, {}, [], {}))

    def payload(self) -> dict[str, Any]:
        with self._lock:
            if time.monotonic() - self._checked >= self.min_interval:
                self._checked = time.monotonic()
                key = self._files()
                if key != self._key:
                    self._key, self._payload = key, self._read()
            return self._payload

    def _files(self) -> tuple:
        out = []
        for f in sorted((self.run.path / "timeline").glob("*.jsonl")):
            try:
                stat = f.stat()
            except OSError:
                continue
            out.append((f.name, stat.st_mtime_ns, stat.st_size))
        return tuple(out)

    def _read(self) -> dict[str, Any]:
        try:
            self._tail.read()
            tl = self._tail.window()
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:  # a file written by something else
            return {"available": False, "why": f"{self.run.name}'s timeline is unreadable: {type(e).__name__}: {e}"}
        return payload(self.run, tl)
