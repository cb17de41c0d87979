"""Served engines in the run's timeline: /metrics parsed (vLLM's and SGLang's names), polled once a bin into a
busy row and queue gauges; a server that stops answering is a gap, not a stuck value."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from areal_agents.engines.server_metrics import SGLANG_METRICS, VLLM_METRICS, ServerMetrics, metric_sum
from areal_agents.timeline import Timeline, read_timeline

VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0
vllm:num_requests_running_total 99
"""


def test_a_gauge_is_summed_over_its_label_sets():
    assert metric_sum(VLLM_TEXT, VLLM_METRICS.running) == 5.0  # two engines; not the _total counter
    assert metric_sum(VLLM_TEXT, VLLM_METRICS.waiting) == 7.0
    assert metric_sum("sglang:num_running_reqs 4\n", SGLANG_METRICS.running) == 4.0
    assert metric_sum(VLLM_TEXT, SGLANG_METRICS.running) is None


@pytest.mark.process
def test_a_polled_server_is_a_busy_row_with_its_queues(tmp_path, monkeypatch):
    monkeypatch.setattr("areal_agents.engines.server_metrics.STALE_S", 0.2)
    state = {"running": 2, "up": True}

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if not state["up"]:
                self.send_error(503)
                return
            body = f"sglang:num_running_reqs {state['running']}\nsglang:num_queue_reqs 1\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_port}"
    tl = Timeline(tmp_path / "timeline", "driver", dt=0.05)
    poller = ServerMetrics([address], SGLANG_METRICS, tl)
    try:
        time.sleep(0.5)
        state["running"] = 0
        time.sleep(0.5)
        state["up"] = False  # its readings go stale: gaps, not the last value forever
        time.sleep(0.6)
    finally:
        poller.close()
        tl.close()
        server.shutdown()
    run = read_timeline(tmp_path)
    row = f"engine/server/127.0.0.1:{server.server_port}"
    busy = run.busy[row][np.isfinite(run.busy[row])]
    assert busy.max() == 1.0 and busy.min() == 0.0  # busy while it ran requests, then idle
    running = run.gauges[f"{row}/running"]
    assert np.nanmax(running) == 2 and np.nanmax(run.gauges[f"{row}/waiting"]) == 1
    assert np.isnan(running[-3:]).all()
