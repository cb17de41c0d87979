"""The run's timeline in stock TensorBoard, as the run trains: a workers x time heatmap image of the steps since
the last one (``timeline/heatmap``, every ``timeline.heatmap_every`` steps), and every queue, in-flight and
utilisation gauge at its own resolution (``RUN/tensorboard/timeline``, under the gauge's name: its step is the
bin's millisecond since the run's first record; TensorBoard's *Relative* or *Wall* x axis shows time).

Example::

    log = TimelineLog(run_dir, metrics, heatmap_every=1)
    log.record(step)   # after each step; `metrics.close()` closes its writer too
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from areal_agents.timeline import timeline
from areal_agents.timeline.heatmap import heatmap_image
from areal_agents.timeline.reader import RunTimeline
from areal_agents.timeline.tail import TimelineTail
from areal_agents.trainers.metrics_writer import MetricsWriter


class TimelineLog:
    """Each step's share of the run's timeline to TensorBoard (see the module docstring)."""

    def __init__(self, run_dir: Path, metrics: MetricsWriter, heatmap_every: int) -> None:
        self.tail = TimelineTail(run_dir, spans=False)  # the pictures need the bins alone
        self.metrics, self.every = metrics, heatmap_every
        self.writer = metrics.subwriter("timeline")
        self.since = time.time()  # the next heatmap starts here (the end of the last one's bins)
        self.logged: dict[str, int] = {}  # gauge -> the step of its last bin written
        self.origin: float | None = None  # the run's first bin: the scalars' step 0

    def record(self, step: int, heatmap: bool = True) -> None:
        """Read what the run's processes wrote since the last step and log it (``heatmap``: the image too, on
        schedule: the bins since the last image's)."""
        timeline().flush(spans=False)  # this process's finished bins now (its sampler writes once a second)
        self.tail.read()
        read = self.tail.window(-math.inf)  # everything read and not yet forgotten: logged once each
        if self.origin is None and read.bins:
            self.origin = read.start
        self._series(read)
        if heatmap and self.every and step % self.every == 0:
            shown = self.tail.window(self.since)
            self.metrics.image(step, "timeline/heatmap", heatmap_image(shown, f"step {step}"))
            self.since = max(self.since, shown.end) if shown.bins else self.since
        self.tail.forget_before(self.since)

    def _series(self, tl: RunTimeline) -> None:
        """Each gauge's new bins as scalars (the busy rows are the heatmap's), each once: a bin's step is its
        millisecond since the run's first bin, compared as an integer (windows' float starts differ a little)."""
        origin = self.origin if self.origin is not None else tl.start
        for name, values in tl.gauges.items():
            last = self.logged.get(name, -1)
            for i in np.flatnonzero(np.isfinite(values)):
                t = tl.start + i * tl.dt
                tick = round((t - origin) * 1000)
                if tick > last:
                    self.writer.add_scalar(name, float(values[i]), tick, walltime=t)
                    self.logged[name] = last = tick
