"""Network helpers the servers and their launchers share: a free port, the /health probe and wait, a log's tail."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def health_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether ``GET {url}/health`` answers 200 within ``timeout`` seconds (no answer counts as no)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def wait_healthy(
    url: str,
    timeout: float,
    *,
    alive: Callable[[], bool] = lambda: True,
    stopped: Callable[[], bool] = lambda: False,
    poll_s: float = 0.2,
) -> bool:
    """Poll ``{url}/health`` until it answers 200 (True), or until ``timeout`` seconds pass, the server's
    process is no longer ``alive`` or the caller has ``stopped`` (False: the caller knows which and says)."""
    deadline = time.monotonic() + timeout
    while alive() and not stopped():
        if health_ok(url, timeout=min(2.0, max(deadline - time.monotonic(), 0.1))):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return False


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a server's log, for an error message."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
