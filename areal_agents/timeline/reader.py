"""A run's timeline read back: every process's file under ``RUN/timeline/`` (`areal_agents.timeline.recorder`)
on one grid of bins, workers' busy shares and gauges as arrays, spans as a list. The heatmap, the trace, the
dashboard and the bottleneck report all start here.

Example::

    tl = read_timeline("runs/arith")
    tl.busy["engine/hf"]           # busy share (0..1) per bin, NaN where the worker recorded nothing
    tl.times()                      # each bin's start, seconds since the run's first bin
    [s for s in tl.spans if s.name == "update"]
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

SPAN_PREFIX = '{"k":"span"'  # how the recorder starts a span's line


@dataclass(frozen=True)
class Span:
    """An event: ``track`` (a worker, or an episode's lane), wall-clock ``start`` and ``end``, its ``args``."""

    process: str
    track: str
    name: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunTimeline:
    """A run's timeline on one grid: bin ``i`` starts at ``start + i * dt`` (wall-clock seconds)."""

    start: float
    dt: float
    busy: dict[str, np.ndarray]  # worker -> busy share per bin (NaN: nothing recorded)
    gauges: dict[str, np.ndarray]  # series -> value per bin (NaN: not sampled)
    spans: list[Span]
    processes: dict[str, str]  # worker or series -> the process that recorded it
    dropped_spans: int = 0

    @property
    def bins(self) -> int:
        return max((len(v) for v in [*self.busy.values(), *self.gauges.values()]), default=0)

    @property
    def end(self) -> float:
        return self.start + self.bins * self.dt

    def times(self) -> np.ndarray:
        """Each bin's start in seconds since the first bin."""
        return np.arange(self.bins) * self.dt

    def coarse(self, max_bins: int) -> RunTimeline:
        """The same timeline in at most ``max_bins`` bins (means of whole groups of bins), for a picture."""
        factor = max(1, math.ceil(self.bins / max(max_bins, 1)))
        if factor == 1:
            return self
        return RunTimeline(
            self.start,
            self.dt * factor,
            {k: _mean_groups(v, factor) for k, v in self.busy.items()},
            {k: _mean_groups(v, factor) for k, v in self.gauges.items()},
            self.spans,
            self.processes,
            self.dropped_spans,
        )

    def busy_share(self, worker: str) -> float:
        """The share of the recorded bins ``worker`` was busy (0 when it recorded none)."""
        v = self.busy[worker]
        return float(np.nanmean(v)) if np.isfinite(v).any() else 0.0


def read_timeline(run_dir: str | Path) -> RunTimeline:
    """Every process's timeline file of ``run_dir`` on one grid (the widest bins any file used). A partial last
    line (a file being written) is skipped; a run with no timeline gives an empty one."""
    records = []
    for path in sorted((Path(run_dir) / "timeline").glob("*.jsonl")):
        record = ProcessRecord()
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            record.add_line(line)
        records.append(record)
    return on_one_grid(records)


def on_one_grid(records: list[ProcessRecord]) -> RunTimeline:
    """Processes' records on one grid: the widest bins any used, from the first bin any recorded."""
    dt = max((r.dt for r in records), default=0.0) or 0.1
    firsts = [t for r in records for t in r.first_times()]
    start = min(firsts) if firsts else 0.0  # a bin's start (flooring it again would lose one to rounding)
    last = max((t for r in records for t in r.last_times()), default=start)
    n = int(math.floor((last - start) / dt + 1e-3)) + 1 if firsts else 0
    busy: dict[str, np.ndarray] = {}
    gauges: dict[str, np.ndarray] = {}
    processes: dict[str, str] = {}
    clash, labels = _names_in_several(records), _labels(records)
    for r, label in zip(records, labels):
        for into, series in ((busy, r.busy), (gauges, r.gauges)):
            for name, points in series.items():
                key = f"{label}:{name}" if name in clash else name
                into[key] = _on_grid(points, start, dt, n)
                processes[key] = label
        for name in r.busy:  # busy time is measured, not sampled: a bin the sampler missed was idle
            _idle_between(busy[f"{label}:{name}" if name in clash else name])
    spans = [replace(s, process=label) for r, label in zip(records, labels) for s in r.spans]
    spans.sort(key=lambda s: s.start)
    dropped = sum(r.dropped for r in records)
    return RunTimeline(start, dt, dict(sorted(busy.items())), dict(sorted(gauges.items())), spans, processes, dropped)


@dataclass
class ProcessRecord:
    """One process's file as read so far: its series as ``{name: {bin_start_time: value}}`` (busy shares summed
    per bin), its spans."""

    process: str = "?"
    pid: int = 0
    dt: float = 0.0  # its widest bins (a file past its budget widens them)
    busy: dict[str, dict[float, float]] = field(default_factory=lambda: defaultdict(dict))
    gauges: dict[str, dict[float, float]] = field(default_factory=lambda: defaultdict(dict))
    spans: list[Span] = field(default_factory=list)
    dropped: int = 0
    keep_spans: bool = True  # False: span lines are skipped unparsed (a reader of bins alone, each step)

    def first_times(self) -> list[float]:
        return [min(p) for p in [*self.busy.values(), *self.gauges.values()] if p]

    def last_times(self) -> list[float]:
        return [max(p) for p in [*self.busy.values(), *self.gauges.values()] if p]

    def add_line(self, line: str) -> None:
        """One line of the file (a partial or garbled one is skipped)."""
        if not self.keep_spans and line.startswith(SPAN_PREFIX):
            return
        try:
            row = json.loads(line)
            kind = row.get("k")
        except (json.JSONDecodeError, AttributeError):
            return  # the line being written
        if kind == "meta":
            self.process, self.pid = str(row.get("process", self.process)), int(row.get("pid", self.pid))
            self.dt = max(self.dt, float(row.get("dt", self.dt)))
        elif kind == "bins":
            _add_bins(self.busy, row.get("busy", {}), float(row["dt"]), summed=True)
            _add_bins(self.gauges, row.get("gauges", {}), float(row["dt"]), summed=False)
        elif kind == "span":
            t, d = float(row["t"]), float(row["d"])
            self.spans.append(Span(self.process, row["track"], row["name"], t, t + d, row.get("args", {})))
        elif kind == "dropped":
            self.dropped = int(row["spans"])


def _add_bins(into: dict[str, dict[float, float]], series: dict[str, Any], dt: float, summed: bool) -> None:
    """``[first_bin, [values...]]`` of bins ``dt`` wide into ``{bin_start_time: value}``; a busy share written
    twice for one bin (a stretch that ended just after its bin was written) adds up, capped at 1."""
    for name, (first, values) in series.items():
        points = into[name]
        for i, v in enumerate(values):
            if v is None:
                continue
            t = round((first + i) * dt, 6)
            points[t] = min(points.get(t, 0.0) + v, 1.0) if summed and t in points else v


def _on_grid(points: dict[float, float], start: float, dt: float, n: int) -> np.ndarray:
    """Values at bin start times onto the grid ``start + i*dt`` (several finer bins into one: their mean)."""
    sums, counts = np.zeros(n), np.zeros(n)
    for t, v in points.items():
        i = int(math.floor((t - start) / dt + 1e-3))  # times near 1.8e9 s are off by ~5e-7 s: 5e-6 of a bin
        if 0 <= i < n:
            sums[i] += v
            counts[i] += 1
    with np.errstate(invalid="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _idle_between(row: np.ndarray) -> None:
    """A busy row's unknown bins between its first and last recorded one are idle (0), in place."""
    known = np.flatnonzero(np.isfinite(row))
    if known.size:
        inside = row[known[0] : known[-1] + 1]
        inside[np.isnan(inside)] = 0.0


def _mean_groups(v: np.ndarray, factor: int) -> np.ndarray:
    pad = (-len(v)) % factor
    padded = np.concatenate([v, np.full(pad, np.nan)]).reshape(-1, factor)
    counts = np.isfinite(padded).sum(axis=1)
    with np.errstate(invalid="ignore"):
        return np.where(counts > 0, np.nansum(padded, axis=1) / np.maximum(counts, 1), np.nan)


def _labels(records: list[ProcessRecord]) -> list[str]:
    """Each record's process name, with its pid where several processes share the name (two rollout workers)."""
    count: dict[str, int] = defaultdict(int)
    for r in records:
        count[r.process] += 1
    return [r.process if count[r.process] == 1 else f"{r.process}.{r.pid}" for r in records]


def _names_in_several(files: list[ProcessRecord]) -> set[str]:
    """Series names more than one file recorded (two servers' ``engine/hf``): those get the process's name."""
    count: dict[str, int] = defaultdict(int)
    for f in files:
        for name in {*f.busy, *f.gauges}:
            count[name] += 1
    return {name for name, c in count.items() if c > 1}
