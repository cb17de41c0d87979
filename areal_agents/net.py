"""Network helpers the servers and their launchers share: a free port, the /health probe and wait, a log's tail,
the request-body cap of the servers (`BodyLimit`)."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


class BodyLimit:
    """ASGI middleware of the servers: a request body over ``max_bytes`` is refused while it is read, with
    the response ``refuse(max_bytes)`` builds (a 413 in the server's error shape). A declared Content-Length
    over the limit is refused at once; any other body (chunked, or a wrong length) is read up to the limit and
    then handed to the app whole, so no more than the limit is ever held, however the body was sent.
    ``served(size)``, when given, runs once the app has answered (serve-model trims the heap after large bodies).

        app.add_middleware(BodyLimit, max_bytes=8 << 20, refuse=lambda n: JSONResponse({...}, 413))
    """

    def __init__(
        self, app: Any, max_bytes: int, refuse: Callable[[int], Any], served: Callable[[int], None] | None = None
    ) -> None:
        self.app, self.max_bytes, self.refuse = app, max_bytes, refuse
        self.served = served  # called with the body's size once the app has answered it

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self.refuse(self.max_bytes)(scope, receive, send)
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away: nobody to answer
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                return await self.refuse(self.max_bytes)(scope, receive, send)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await self.app(scope, replay, send)
        finally:
            if self.served is not None:
                self.served(seen)
