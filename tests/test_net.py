"""The network helpers every launcher uses: a free port, the /health probe and the wait for it."""

import http.server
import threading
import time

import pytest

from areal_agents.net import free_port, health_ok, log_tail, wait_healthy


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802  (http.server's name)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _serve(status: int):
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.process
def test_a_healthy_server_is_found_at_once():
    server, url = _serve(200)
    try:
        assert health_ok(url)
        assert wait_healthy(url, timeout=5)
    finally:
        server.shutdown()


@pytest.mark.process
def test_a_server_answering_503_times_out_and_a_dead_one_ends_the_wait_early():
    server, url = _serve(503)
    try:
        assert not health_ok(url)
        start = time.monotonic()
        assert not wait_healthy(url, timeout=0.5, poll_s=0.05)
        assert time.monotonic() - start >= 0.5
    finally:
        server.shutdown()
    nobody = f"http://127.0.0.1:{free_port()}"
    assert not wait_healthy(nobody, timeout=60, alive=lambda: False)  # its process ended: no 60 s wait
    assert not wait_healthy(nobody, timeout=60, stopped=lambda: True)


def test_log_tail_reads_the_end_or_says_there_is_none(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("\n".join(f"line {i}" for i in range(30)))
    assert log_tail(log, lines=2) == "line 28\nline 29"
    assert log_tail(tmp_path / "missing.log") == "(no log)"
