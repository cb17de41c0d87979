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

import contextvars
import time

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("env_call_deadline", default=None)


class call_deadline:  # noqa: N801  (used as a function: ``with call_deadline(60.0):``)
    """Within this block, `remaining_s` counts down from ``seconds`` (None: no deadline). A class, not a
    generator: the env server enters one around every step, and a generator's context manager costs more."""

    __slots__ = ("seconds", "token")

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        self.token = _deadline.set(None if self.seconds is None else time.monotonic() + self.seconds)

    def __exit__(self, *exc: object) -> None:
        _deadline.reset(self.token)


def remaining_s() -> float | None:
    """Seconds left to the current served call (0 when past it), or None outside one."""
    deadline = _deadline.get()
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)
