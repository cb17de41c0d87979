"""Hand-made run timelines for the trace and bottleneck tests: real recorder files written on a fake clock, so
each worker's busy bins, each gauge and each span are exactly what a test says."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_agents.timeline import recorder as rec

T0 = 1000.0  # the fake wall clock's start
DT = 0.1


class Clock:
    """``time.time`` that moves only when told (``monotonic`` stays put: the sampler thread never flushes)."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return 0.0


@dataclass
class Process:
    """One process's record: busy intervals per worker, gauges as functions of time, spans (seconds from T0)."""

    name: str = "driver"
    busy: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    gauges: dict[str, Callable[[float], float]] = field(default_factory=dict)
    spans: list[tuple[str, str, float, float, dict[str, Any]]] = field(default_factory=list)  # track, name, a, b, args

    def span(self, track: str, name: str, a: float, b: float, **args: Any) -> None:
        self.spans.append((track, name, a, b, args))


def record(run_dir: Path, clock: Clock, process: Process, until: float, since: float = 0.0) -> None:
    """Write ``process``'s timeline file under ``run_dir/timeline`` as the recorder would over ``[since, until)``."""
    clock.now = T0 + since
    tl = rec.Timeline(run_dir / "timeline", process.name, dt=DT)
    for worker in process.busy:
        tl.idle(worker)
    for name, fn in process.gauges.items():
        tl.gauge(name, lambda fn=fn: fn(clock.now - T0))
    changes = sorted((t, kind, w) for w, ivs in process.busy.items() for a, b in ivs for t, kind in ((a, 1), (b, 0)))
    for k in range(round(since / DT), round(until / DT)):
        mid = (round(T0 / DT) + k + 0.5) * DT  # sample mid-bin: no float edge cases
        while changes and T0 + changes[0][0] <= mid:
            t, kind, worker = changes.pop(0)
            clock.now = T0 + t
            (tl.enter if kind else tl.leave)(worker)
        clock.now = mid
        tl.sample()
    for track, name, a, b, args in process.spans:
        tl.add_span(track, name, T0 + a, T0 + b, keep=True, **args)
    tl.close()


def write_run(run_dir: Path, clock: Clock, processes: list[Process], until: float, config: dict | None = None) -> Path:
    """A run dir with each process's timeline file (and ``config.json`` when given)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for p in processes:
        record(run_dir, clock, p, until)
    if config is not None:
        (run_dir / "config.json").write_text(json.dumps(config))
    return run_dir


def sync_steps(p: Process, steps: int, wait: float, update: float, push: float = 0.1, **extra: float) -> float:
    """``steps`` synchronous steps on the driver track (wait for the batch, update, push, then ``extra`` phases:
    ``eval=...``, ``checkpoint=...``), the engine busy while waiting and the trainer while updating; returns
    the run's end."""
    t = 0.5  # start-up
    for step in range(1, steps + 1):
        start = t
        phases = {"rollout_wait": wait, "update": update, "weight_push": push, **extra}
        for name, seconds in phases.items():
            p.span("driver", name, t, t + seconds, step=step)
            t += seconds
        p.span("driver", "step", start, t, step=step)
        p.busy.setdefault("engine/hf", []).append((start, start + wait))
        p.busy.setdefault("trainer/default", []).append((start + wait, start + wait + update))
    return t + 0.5
