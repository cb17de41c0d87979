"""What a run and its model servers agree on about control: the admin key that guards serve-model's control
routes (pause, weights, adapters, weight groups) and what /health says of a server paused on purpose.

The key travels as ``Authorization: Bearer KEY`` (SGLang's and vLLM's ``--api-key`` header, so a server of
theirs started with the same key takes it too); `ADMIN_KEY_ENV` holds it where no flag or argument names it
(serve-model's ``--admin-key``, `RemoteEngine`'s ``admin_key``, the `Supervisor`). A paused serve-model answers
/health with 503 and ``{"status": "paused", ...}``: not healthy, since nothing generates, but not failed
either, so `health_state` tells it from a dead server (a trainer pauses every server for each weight update).

    health_state(503, {"status": "paused", "error": {...}})   # "paused": leave it running
    health_state(503, {"error": {"message": "decode thread failed"}})   # "failed": restart it
"""

from __future__ import annotations

import os
from typing import Any, Literal

ADMIN_KEY_ENV = "AREAL_ADMIN_KEY"  # the admin key where no flag names it (kept off command lines)
PAUSED = "paused"  # /health's "status" while a server is paused on purpose

HealthState = Literal["ok", "paused", "failed", "silent"]


def admin_key_from_env(key: str | None = None) -> str | None:
    """``key``, else `ADMIN_KEY_ENV`'s value; None when neither is set (or empty)."""
    return key or os.environ.get(ADMIN_KEY_ENV) or None


def admin_headers(key: str | None) -> dict[str, str]:
    """The headers that carry ``key`` (none without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def paused_body(paused_s: float) -> dict[str, Any]:
    """serve-model's /health body while paused (with status 503): SGLang's error shape, and the state."""
    message = (
        f"generation is paused (/pause_generation, {paused_s:.0f}s ago); /continue_generation resumes it: "
        "the server is alive, and requests wait"
    )
    return {"status": PAUSED, "paused_s": round(paused_s, 3), "error": {"message": message}}


def health_state(status: int | None, body: Any) -> HealthState:
    """What a /health reply says: ``ok`` (200), ``paused`` (503 saying so: alive, generating nothing on
    purpose), ``failed`` (any other error status: serve-model's decode loop failed) or ``silent`` (no reply)."""
    if status is None:
        return "silent"
    if status == 200:
        return "ok"
    if status == 503 and isinstance(body, dict) and body.get("status") == PAUSED:
        return "paused"
    return "failed"
