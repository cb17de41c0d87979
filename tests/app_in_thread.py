"""An ASGI app (serve-env's, serve-model's) under uvicorn on a thread of the test process: real HTTP on a free
port, with the app's objects in reach of the test."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from areal_agents.net import free_port


@contextmanager
def serving_app(app, port: int | None = None) -> Iterator[str]:
    """``app`` served until the block ends; its base URL."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the app's server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
