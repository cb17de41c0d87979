"""A run's timeline as a Chrome/Perfetto trace (the Trace Event Format's JSON object form): open it at
https://ui.perfetto.dev ("Open trace file") or chrome://tracing to see every worker of the run on one timeline.

Each process of the run is a trace process; in it, one thread track per span track (``driver``: steps,
rollout waits, updates, weight pushes, evals, checkpoints), per lane of episodes (an episode's ``episode``
slice with its turns' ``generate`` and ``env_step`` inside) and per worker (its busy stretches as slices),
and one counter track per gauge and per worker's busy share. Times are microseconds since the run's first
record; the wall-clock start is in ``otherData``.

Example::

    trace = build_trace(read_timeline("runs/arith/rl"))   # {"traceEvents": [...], ...}
    write_trace("runs/arith/rl")                          # runs/arith/rl/trace.json
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from areal_agents.errors import ArealAgentsError
from areal_agents.timeline.reader import RunTimeline, Span, read_timeline

EPISODES = "episodes"  # the span track whose spans are grouped by their episode_id into lanes
ROOT = "episode"  # the span that holds an episode's turns
MAX_BINS = 20_000  # busy shares and gauges of a longer run are averaged into this many bins (a file Perfetto opens)


@dataclass
class _Ids:
    """Integer pids and tids of the trace, in the order they were first asked for (the driver's first)."""

    pids: dict[str, int] = field(default_factory=dict)
    tids: dict[tuple[int, str], int] = field(default_factory=dict)

    def pid(self, process: str) -> int:
        return self.pids.setdefault(process, len(self.pids) + 1)

    def tid(self, pid: int, thread: str) -> int:
        return self.tids.setdefault((pid, thread), sum(1 for p, _ in self.tids if p == pid) + 1)

    def metadata(self) -> list[dict[str, Any]]:
        """``process_name``/``thread_name`` events and sort indices, so tracks are named and keep this order."""
        out: list[dict[str, Any]] = []
        for name, pid in self.pids.items():
            out.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}})
            out.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}})
        for (pid, thread), tid in self.tids.items():
            out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}})
            out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
        return out


def build_trace(run: RunTimeline, max_bins: int = MAX_BINS) -> dict[str, Any]:
    """The trace of ``run`` as a JSON-ready dict (``traceEvents``: metadata first, then events by time); busy
    shares and gauges in at most ``max_bins`` bins (a long run's, averaged), spans as recorded."""
    t0 = _origin(run)
    bins = run.coarse(max_bins)
    ids = _Ids()
    for process in _processes(run):
        ids.pid(process)
    events: list[dict[str, Any]] = []
    by_track: dict[tuple[str, str], list[Span]] = defaultdict(list)
    for s in run.spans:
        by_track[(s.process, s.track)].append(s)
    for (process, track), spans in sorted(by_track.items(), key=lambda kv: (kv[0][1] == EPISODES, kv[0])):
        pid = ids.pid(process)
        if track == EPISODES:
            events += _episode_events(spans, t0, pid, ids)
        else:
            events += _track_events(spans, track, t0, pid, ids)
    for worker, shares in bins.busy.items():
        events += _busy_events(worker, shares, bins, t0, ids)
    for name, values in bins.gauges.items():
        pid = ids.pid(bins.processes.get(name, "?"))
        events += _counter_events(name, values, bins, t0, pid)
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    other = {"start_unix_s": t0, "bin_s": bins.dt, "dropped_spans": run.dropped_spans}
    return {"traceEvents": ids.metadata() + events, "displayTimeUnit": "ms", "otherData": other}


def write_trace(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``run_dir``'s trace to ``out`` (default ``run_dir/trace.json``); refuse a run with no timeline."""
    run = read_timeline(run_dir)
    if run.bins == 0 and not run.spans:
        raise ArealAgentsError(
            f"{run_dir}: no timeline recorded (expected {Path(run_dir) / 'timeline'}/*.jsonl); "
            "runs record one while they train"
        )
    path = Path(out) if out is not None else Path(run_dir) / "trace.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    trace = build_trace(run)
    path.write_text(json.dumps(trace, separators=(",", ":"), default=str), encoding="utf-8")
    return path


def trace_lines(path: Path) -> list[str]:
    """What `areal-agents trace` prints about the file it wrote."""
    return [
        f"trace: {path}",
        "open it at https://ui.perfetto.dev (Open trace file) or in chrome://tracing (Load)",
    ]


# -- spans ---------------------------------------------------------------------------------------------------


def _us(t: float, t0: float) -> int:
    return int(round((t - t0) * 1e6))


def _complete(s: Span, start: int, end: int, pid: int, tid: int) -> dict[str, Any]:
    event = {"ph": "X", "name": s.name, "cat": s.track, "ts": start, "dur": max(end - start, 0), "pid": pid}
    event["tid"] = tid
    if s.args:
        event["args"] = s.args
    return event


def _nest_lanes(intervals: list[tuple[int, int]]) -> list[int]:
    """A lane for each ``(start, end)`` such that the intervals of one lane nest or follow one another (a
    slice that would overlap another only in part goes to a further lane), fewest lanes first-fit."""
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1]))
    stacks: list[list[int]] = []  # each lane's open slices' ends, innermost last
    lanes = [0] * len(intervals)
    for i in order:
        start, end = intervals[i]
        lane = next((k for k, stack in enumerate(stacks) if _fits(stack, start, end)), len(stacks))
        if lane == len(stacks):
            stacks.append([])
        stacks[lane].append(end)
        lanes[i] = lane
    return lanes


def _fits(stack: list[int], start: int, end: int) -> bool:
    """Close the lane's slices that ended by ``start``; True when ``[start, end)`` then nests in the lane."""
    while stack and stack[-1] <= start:
        stack.pop()
    return not stack or end <= stack[-1]


def _lane_name(track: str, lane: int) -> str:
    return track if lane == 0 else f"{track} ({lane + 1})"


def _track_events(spans: list[Span], track: str, t0: float, pid: int, ids: _Ids) -> list[dict[str, Any]]:
    """A span track's slices, on as many thread tracks as it needs for slices to nest."""
    intervals = [(_us(s.start, t0), _us(s.end, t0)) for s in spans]
    lanes = _nest_lanes(intervals)
    return [
        _complete(s, a, b, pid, ids.tid(pid, _lane_name(track, lane)))
        for s, (a, b), lane in zip(spans, intervals, lanes, strict=True)
    ]


@dataclass
class _Unit:
    """An episode's slices: its ``episode`` slice (when recorded) and its turns', each on a sub-lane."""

    root: Span | None
    children: list[Span]

    @property
    def start(self) -> float:
        return self.root.start if self.root else min(c.start for c in self.children)

    @property
    def end(self) -> float:
        return self.root.end if self.root else max(c.end for c in self.children)


def _episode_units(spans: list[Span]) -> list[_Unit]:
    """Spans of the episodes track grouped by episode: each turn with the ``episode`` slice of its
    ``episode_id`` that holds its start (a retried episode has several); turns of none form their own unit.
    Calls with no ``episode_id`` are not here (`_episode_events` lays them out)."""
    by_id: dict[Any, list[Span]] = defaultdict(list)
    units: list[_Unit] = []
    for s in spans:
        key = s.args.get("episode_id")
        if key is None and s.name == ROOT:
            units.append(_Unit(s, []))
        elif key is not None:
            by_id[str(key)].append(s)
    for group in by_id.values():
        roots = [_Unit(s, []) for s in group if s.name == ROOT]
        orphans = _Unit(None, [])
        for s in group:
            if s.name != ROOT:
                home = next((u for u in roots if u.root.start <= s.start <= u.root.end), orphans)  # type: ignore[union-attr]
                home.children.append(s)
        units += roots + ([orphans] if orphans.children else [])
    return units


def _merged(spans: list[Span]) -> list[Span]:
    """Spans of one name that overlap as one slice over their union, ``args["calls"]`` counting them (the
    64 resets a run's start makes at once are one slice, not 64 lanes)."""
    out: list[Span] = []
    for name in sorted({s.name for s in spans}):
        cluster: list[Span] = []
        for s in sorted((s for s in spans if s.name == name), key=lambda s: s.start):
            if cluster and s.start >= max(c.end for c in cluster):
                out.append(_one(cluster))
                cluster = []
            cluster.append(s)
        out.append(_one(cluster))
    return out


def _one(cluster: list[Span]) -> Span:
    first = cluster[0]
    if len(cluster) == 1:
        return first
    end = max(c.end for c in cluster)
    return Span(first.process, first.track, first.name, first.start, end, {"calls": len(cluster)})


def _episode_events(spans: list[Span], t0: float, pid: int, ids: _Ids) -> list[dict[str, Any]]:
    """Episodes on lanes ``episodes 1..N``: each episode takes the first lanes free for its whole life, so
    overlapping episodes sit side by side and its turns nest inside its slice. Calls outside any episode
    (a run's first resets) go to lanes of their own, ``outside episodes``, overlapping ones of a name merged."""
    outside = [s for s in spans if s.name != ROOT and s.args.get("episode_id") is None]
    events = _track_events(_merged(outside), "outside episodes", t0, pid, ids) if outside else []
    free_at: list[int] = []  # each lane's end of its last episode
    for unit in sorted(_episode_units(spans), key=lambda u: (u.start, u.end)):
        lo, hi = _us(unit.start, t0), _us(unit.end, t0)
        clipped = [(min(max(_us(c.start, t0), lo), hi), min(max(_us(c.end, t0), lo), hi)) for c in unit.children]
        sub = _nest_lanes(clipped)
        width = max(sub, default=0) + 1
        base = next(b for b in range(len(free_at) + 1) if all(f <= lo for f in free_at[b : b + width]))
        free_at += [0] * max(0, base + width - len(free_at))
        for lane in range(base, base + width):
            free_at[lane] = hi
        tid = [ids.tid(pid, f"{EPISODES} {base + j + 1}") for j in range(width)]
        if unit.root is not None:
            events.append(_complete(unit.root, lo, hi, pid, tid[0]))
        events += [_complete(c, a, b, pid, tid[j]) for c, (a, b), j in zip(unit.children, clipped, sub, strict=True)]
    return events


# -- bins ----------------------------------------------------------------------------------------------------


def _busy_events(worker: str, shares: np.ndarray, run: RunTimeline, t0: float, ids: _Ids) -> list[dict[str, Any]]:
    """A worker's thread track: one ``busy`` slice per stretch of bins it was busy in (its mean share in
    ``args``), and a counter of its busy share per bin."""
    pid = ids.pid(run.processes.get(worker, "?"))
    tid = ids.tid(pid, worker)
    events: list[dict[str, Any]] = []
    for first, last in _stretches(np.nan_to_num(shares, nan=0.0) > 0):
        a, b = _us(run.start + first * run.dt, t0), _us(run.start + (last + 1) * run.dt, t0)
        share = round(float(np.mean(shares[first : last + 1])), 3)
        events.append({"ph": "X", "name": "busy", "cat": "busy", "ts": a, "dur": b - a, "pid": pid, "tid": tid})
        events[-1]["args"] = {"share": share}
    return events + _counter_events(f"{worker} busy", shares, run, t0, pid)


def _stretches(mask: np.ndarray) -> list[tuple[int, int]]:
    """``(first, last)`` bin of each run of True in ``mask``."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), (np.flatnonzero(edges == -1) - 1).tolist(), strict=True))


def _counter_events(name: str, values: np.ndarray, run: RunTimeline, t0: float, pid: int) -> list[dict[str, Any]]:
    """A counter track: a ``C`` event where the value changes (an unknown bin holds the last value)."""
    events: list[dict[str, Any]] = []
    last = math.nan
    for i, v in enumerate(values.tolist()):
        if math.isfinite(v) and v != last:
            ts = _us(run.start + i * run.dt, t0)
            events.append({"ph": "C", "name": name, "ts": ts, "pid": pid, "tid": 0, "args": {"value": v}})
            last = v
    return events


def _origin(run: RunTimeline) -> float:
    """The trace's time zero: the run's first bin or first span, whichever is earlier."""
    starts = [s.start for s in run.spans] + ([run.start] if run.bins else [])
    return min(starts, default=0.0)


def _processes(run: RunTimeline) -> list[str]:
    """The run's processes, the driver's first, then by name."""
    names = {s.process for s in run.spans} | set(run.processes.values())
    return sorted(names, key=lambda p: (p != "driver", p))


def trace_command(run_dir: str, out: str | None = None) -> None:
    """`areal-agents trace RUN [--out PATH]`: write the trace, say how to open it, print the bottleneck report."""
    from areal_agents.timeline.bottleneck import report_lines

    path = write_trace(run_dir, out)
    print("\n".join([*trace_lines(path), "", *report_lines(run_dir)]))
