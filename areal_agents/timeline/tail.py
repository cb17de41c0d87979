"""`TimelineTail`: a run's timeline files followed as they grow, for what a live run shows of itself (each
step's heatmap, the queue scalars): each `read` parses only the lines added since the last one, and what is
older than the caller still needs is forgotten, so following a long run costs no more than a short one.

Example::

    tail = TimelineTail(run_dir)
    tail.read()
    recent = tail.window(since=step_started)   # a RunTimeline of those bins alone
    tail.forget_before(step_started)
"""

from __future__ import annotations

from pathlib import Path

from areal_agents.timeline.reader import ProcessRecord, RunTimeline, on_one_grid


class TimelineTail:
    """Follows ``RUN/timeline/*.jsonl`` (files that appear later too)."""

    def __init__(self, run_dir: str | Path, spans: bool = True) -> None:
        """``spans=False``: bins and gauges alone (span lines are not parsed)."""
        self.directory = Path(run_dir) / "timeline"
        self.spans = spans
        self.records: dict[Path, ProcessRecord] = {}
        self.offsets: dict[Path, int] = {}

    def read(self) -> None:
        """Parse the whole lines added since the last read (a line being written waits for the next)."""
        for path in sorted(self.directory.glob("*.jsonl")):
            record = self.records.setdefault(path, ProcessRecord(keep_spans=self.spans))
            with path.open("rb") as f:
                f.seek(self.offsets.get(path, 0))
                chunk = f.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(whole)
            for line in whole.decode("utf-8", errors="replace").splitlines():
                record.add_line(line)

    def window(self, since: float = 0.0) -> RunTimeline:
        """The bins and spans read so far from wall-clock time ``since`` on, on one grid."""
        return on_one_grid([_since(r, since) for r in self.records.values()])

    def forget_before(self, t: float) -> None:
        """Drop the bins and spans that ended before wall-clock time ``t``."""
        for record in self.records.values():
            for series in (*record.busy.values(), *record.gauges.values()):
                for k in [k for k in series if k < t - record.dt]:
                    del series[k]
            record.spans = [s for s in record.spans if s.end >= t]


def _since(record: ProcessRecord, t: float) -> ProcessRecord:
    """``record``'s bins that end after ``t`` and spans that do."""
    out = ProcessRecord(record.process, record.pid, record.dt, dropped=record.dropped)
    for into, series in ((out.busy, record.busy), (out.gauges, record.gauges)):
        for name, points in series.items():
            kept = {k: v for k, v in points.items() if k + record.dt > t}
            if kept:
                into[name] = kept
    out.spans = [s for s in record.spans if s.end >= t]
    return out
