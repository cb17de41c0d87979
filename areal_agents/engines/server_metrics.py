"""Served engines in the run's timeline: a thread polls each server's Prometheus ``/metrics`` once a bin for its
running and waiting requests (vLLM's ``vllm:num_requests_*``, SGLang's ``sglang:num_*_reqs``, which serve-model
answers too), and the timeline samples the latest readings: row ``engine/server/HOST:PORT`` (busy while the
server runs requests), gauges ``engine/server/HOST:PORT/running`` and ``.../waiting``.

Example::

    poller = ServerMetrics(["http://127.0.0.1:30000"], VLLM_METRICS, timeline())
    ...
    poller.close()
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from dataclasses import dataclass

from areal_agents.timeline import NullTimeline, Timeline


@dataclass(frozen=True)
class MetricNames:
    """A server's Prometheus names for its running and its waiting requests."""

    running: str
    waiting: str


VLLM_METRICS = MetricNames("vllm:num_requests_running", "vllm:num_requests_waiting")
SGLANG_METRICS = MetricNames("sglang:num_running_reqs", "sglang:num_queue_reqs")
STALE_S = 2.0  # a reading older than this is no reading (a gap in the timeline, not a stuck value)


def metric_sum(text: str, name: str) -> float | None:
    """The sum over label sets of gauge ``name`` in a Prometheus text exposition (None: absent)."""
    values = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([-+0-9.eE]+|NaN)$", text, re.M)
    return sum(float(v) for v in values) if values else None


class ServerMetrics:
    """Polls ``addresses``' ``/metrics`` every bin of ``tl`` on a daemon thread (see the module docstring)."""

    def __init__(self, addresses: list[str], names: MetricNames, tl: Timeline | NullTimeline) -> None:
        self.addresses, self.names, self.tl = list(addresses), names, tl
        self.period = tl.dt
        self.readings: dict[str, tuple[float, float, float]] = {}  # address -> (when, running, waiting)
        self._stop = threading.Event()
        for address in self.addresses:
            row = f"engine/server/{address.split('://')[-1]}"
            tl.busy_fraction(row, lambda a=address: self._reading(a, 1, busy=True))
            tl.gauge(f"{row}/running", lambda a=address: self._reading(a, 1))
            tl.gauge(f"{row}/waiting", lambda a=address: self._reading(a, 2))
        self._thread = threading.Thread(target=self._poll, name="server-metrics", daemon=True)
        self._thread.start()

    def _reading(self, address: str, index: int, busy: bool = False) -> float:
        reading = self.readings.get(address)
        if reading is None or time.monotonic() - reading[0] > STALE_S:
            raise LookupError(address)  # the timeline records a gap
        value = reading[index]
        return float(value > 0) if busy else value

    def _poll(self) -> None:
        while not self._stop.wait(self.period):
            for address in self.addresses:
                try:
                    with urllib.request.urlopen(f"{address}/metrics", timeout=max(self.period * 5, 1.0)) as r:
                        text = r.read().decode("utf-8", errors="replace")
                except OSError:
                    continue  # down or slow: its reading goes stale
                running, waiting = metric_sum(text, self.names.running), metric_sum(text, self.names.waiting)
                if running is not None:
                    self.readings[address] = (time.monotonic(), running, waiting or 0.0)

    def close(self) -> None:
        """Stop polling; the timeline forgets these series."""
        self._stop.set()
        for address in self.addresses:
            row = f"engine/server/{address.split('://')[-1]}"
            for name in (row, f"{row}/running", f"{row}/waiting"):
                self.tl.forget(name)
