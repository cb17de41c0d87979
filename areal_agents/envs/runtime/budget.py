"""The time left to a served env call: the env server sets a deadline around each reset and step, and an env
that runs long work inside one (Code-v0's sandbox runs, Math-v0's verification) cuts that work to it, so a
call that times out leaves nothing running that holds a worker.

    with call_deadline(60.0):       # the server, around ``await env.astep(action)``
        ...
    remaining_s()                   # in the env's step: seconds left, or None (no server, no deadline)

Thread- and inline-mode pools run the env in the server's context, so they see it; a process-mode worker
does not, and is killed at the timeout instead (its sandboxes die with it).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("env_call_deadline", default=None)


@contextlib.contextmanager
def call_deadline(seconds: float | None) -> Iterator[None]:
    """Within this block, `remaining_s` counts down from ``seconds`` (None: no deadline)."""
    token = _deadline.set(None if seconds is None else time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def remaining_s() -> float | None:
    """Seconds left to the current served call (0 when past it), or None outside one."""
    deadline = _deadline.get()
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)
