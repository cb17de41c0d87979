"""serve-model against its clients: what every request passes before a route sees it, and what ends a request
whose client went away.

- `ClientGuard` (ASGI middleware): the control routes (`CONTROL_ROUTES`) want the admin key when the server
  has one (401 otherwise, before the body is read); a body over ``max_body_bytes`` is refused with 413 while
  it is read (a declared length at once), so no more than that is ever held; after a large body has been
  served, the heap's free memory goes back to the OS (`trim_heap`).
- `parse_body`: the JSON of a body, a 400 (`BodyError`, naming the field) for what is not JSON, nests past
  Python's parser or holds a lone UTF-16 surrogate (``"\\ud800"``: not text, and the tokenizer's crash).
- `unless_gone`: runs a route's work while watching the connection; a client that disconnects cancels it,
  which aborts its requests (every branch of its ``n``) at the engine's next decode step.

    app.add_middleware(ClientGuard, max_body_bytes=16 << 20, admin_key="s3cret")
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import re
import secrets
from collections.abc import Awaitable
from typing import Any

from fastapi.responses import JSONResponse, Response

from areal_agents.engines.sglang.protocol import ProtocolError
from areal_agents.net import BodyLimit

# Routes that change what the server serves or whether it serves: the admin key guards them when one is set.
# (/abort_request guards its abort_all in the route: aborting one's own request by rid stays open.)
CONTROL_ROUTES = frozenset(
    {
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    }
)
CLIENT_GONE = 499  # nginx's "client closed request": the status of a reply nobody reads
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]", re.ASCII)  # \ud800-\udfff in a body's JSON text
_SURROGATE = re.compile("[\ud800-\udfff]")
# JSON values one body may hold by default (counted by the separators before them): the parser holds the GIL,
# and so the event loop, for its whole run; half a million of the costliest values (object members) took ~0.5 s
MAX_JSON_VALUES = 1 << 19
# A body this large (and its parse) leaves free memory in glibc's heap; it is returned to the OS once served
TRIM_AFTER_BYTES = 1 << 20


class BodyError(ProtocolError):
    """A body refused before any route reads it (400); ``field`` names where, when it is a field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def guard_error(status: int, message: str) -> JSONResponse:
    """An error both SGLang's clients (``error.message``) and OpenAI's (``type``, ``param``, ``code``) read."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def is_admin(authorization: str | None, admin_key: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``admin_key`` (always, when the server has none)."""
    if not admin_key:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), admin_key.encode())


class ClientGuard:
    """ASGI middleware: the admin key on control routes, then the body size cap enforced while reading
    (`BodyLimit`)."""

    def __init__(self, app: Any, max_body_bytes: int, admin_key: str | None = None) -> None:
        self.app, self.admin_key = app, admin_key
        self.limited = BodyLimit(app, max_body_bytes, refuse=_too_large, served=_trim_after_large)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in CONTROL_ROUTES:
            headers = {k.lower(): v for k, v in scope.get("headers") or []}
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not is_admin(auth, self.admin_key):
                message = (
                    f"{scope['path']} is a control route: send the server's admin key (--admin-key) "
                    "as 'Authorization: Bearer KEY'"
                )
                return await guard_error(401, message)(scope, receive, send)
        await self.limited(scope, receive, send)


def _trim_after_large(body_bytes: int) -> None:
    if body_bytes >= TRIM_AFTER_BYTES:
        trim_heap()


def trim_heap() -> None:
    """Return the heap's free memory to the OS (glibc's ``malloc_trim``; a no-op elsewhere). A burst of large
    bodies otherwise stays resident in glibc's arenas. Fixing glibc's mmap threshold low instead (every block
    of 1 MiB or more mmapped and unmapped) made every tensor of the engine's a fresh, page-faulting mapping:
    its steps ran ~1.4x slower. The engine's heap kept by `keep_freed_memory` is given back too, and faults
    again once as the engine reuses it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _too_large(max_body_bytes: int) -> JSONResponse:
    return guard_error(413, f"the request body is over {max_body_bytes} bytes (--max-body-bytes)")


def parse_body(raw: bytes, required: bool = False, max_values: int = MAX_JSON_VALUES) -> Any:
    """The JSON of ``raw`` (``{}`` for an empty body unless ``required``); `BodyError` otherwise, or when it
    holds more than ``max_values`` values (counted before parsing, from the separators)."""
    if not raw.strip():
        if required:
            raise BodyError("a JSON body is required")
        return {}
    values = sum(raw.count(c) for c in (b",", b"[", b"{", b":"))  # every value but the first follows one
    if values > max_values:
        raise BodyError(f"the body holds about {values} JSON values, over {max_values} (--max-json-values)")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BodyError("the body nests deeper than the JSON parser goes (about 1000 levels)") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise BodyError(f"the body is not valid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then walk the body for the string that holds one
        where = _lone_surrogate(body)
        if where is not None:
            raise BodyError("holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text", where)
    return body


def _lone_surrogate(body: Any) -> str | None:
    """The path (``messages[0].content``) of the first string or key of ``body`` with a lone surrogate."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    return path or "body"
                stack.append((item, where))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None


async def unless_gone(receive: Any, work: Awaitable[Response]) -> Response:
    """``work``'s response; if the client disconnects first, ``work`` is cancelled (its engine requests are
    aborted at the next decode step) and the reply is a `CLIENT_GONE` nobody reads."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.cancelled() and task.done():
        return task.result()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return Response(status_code=CLIENT_GONE)


async def _disconnected(receive: Any) -> None:
    """Returns once the client has disconnected (never, if the connection cannot tell)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001  (cannot tell: never claim the client left)
        await asyncio.get_running_loop().create_future()
