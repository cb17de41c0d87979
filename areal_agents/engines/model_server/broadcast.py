"""serve-model's side of SGLang's broadcast weight update, over gloo: ``/init_weights_update_group`` joins
the trainer's group (`engines.broadcast_group`), ``/update_weights_from_distributed`` receives one bucket, and
``/destroy_weights_update_group`` leaves a group. Buckets are staged until every parameter of the model
has arrived, then loaded at once through ``HFEngine.update_weights`` (checked whole, then pause, swap,
version, resume), so a push cut short by a dead peer or refused (a NaN, a wrong shape) never leaves half-new
weights; SGLang loads bucket by bucket instead, which the client's pause around the whole push makes look the
same from outside. A bucket whose announcement does not fit the model (an unknown name, a wrong shape or
dtype) is refused before a byte is received, and its group closed, so the trainer's broadcast fails at once
instead of waiting out its timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from areal_agents.engines.broadcast_group import WeightGroup, join_group, receive
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.sglang.protocol import ProtocolError
from areal_agents.errors import EngineError
from areal_agents.models.weight_checks import check_announced

GROUP_TIMEOUT_S = 120.0  # a broadcast this server waits in fails after this long (the trainer's is its own)
INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size")


class BroadcastReceiver:
    """The weight groups this server belongs to (by name) and the tensors received of the current push.

    It loads a complete push into ``engine`` under ``update_lock`` (the server's, held by every weight
    change), then calls ``name_version(version, weight_version)`` with the new version and the name the
    trainer gave it. ``refuse_flush(route, body)``: the reply refusing a bucket whose ``flush_cache`` SGLang
    could not honour now, or None (the server's `ModelServer.flush_refused`)."""

    def __init__(
        self,
        engine: HFEngine,
        update_lock: asyncio.Lock,
        name_version: Callable[[int, Any], None],
        refuse_flush: Callable[[str, dict], JSONResponse | None] = lambda route, body: None,
        timeout_s: float = GROUP_TIMEOUT_S,
    ) -> None:
        self.engine, self.update_lock, self.name_version = engine, update_lock, name_version
        self.refuse_flush = refuse_flush
        self.timeout_s = timeout_s
        self.groups: dict[str, WeightGroup] = {}
        self.staged: dict[str, Any] = {}
        self.spec = engine.weight_spec  # a push is complete once every tensor of it has come
        self.joining = asyncio.Lock()  # one group init at a time (each waits for its peers up to timeout_s)

    async def init_group(self, body: dict) -> JSONResponse:
        missing = [k for k in INIT_FIELDS if body.get(k) is None]
        if missing:
            raise ProtocolError(f"init_weights_update_group: {', '.join(missing)} required")
        name = str(body.get("group_name", "weight_update_group"))
        backend = body.get("backend", "gloo")
        if backend != "gloo":
            return _reply(False, f"serve-model joins weight groups over gloo (CPU), got backend {str(backend)[:60]!r}")
        try:  # one at a time: a join holds a thread until its peers come or timeout_s passes
            await asyncio.wait_for(self.joining.acquire(), self.timeout_s)
        except TimeoutError:
            message = f"init_weights_update_group: another group init has taken over {self.timeout_s:.0f}s; try again"
            return JSONResponse({"success": False, "message": message}, status_code=409)
        try:
            return await self._join(name, backend, body)
        finally:
            self.joining.release()

    async def _join(self, name: str, backend: str, body: dict) -> JSONResponse:
        """Join group ``name`` (leaving a group of that name first), under ``joining``."""
        self.close(name)
        try:
            group = await asyncio.to_thread(
                join_group,
                str(body["master_address"]),
                int(body["master_port"]),
                rank=int(body["rank_offset"]),
                world_size=int(body["world_size"]),
                group_name=name,
                backend=backend,
                timeout_s=self.timeout_s,
            )
        except Exception as e:  # noqa: BLE001  (SGLang answers success=false)
            return _reply(False, f"Failed to init group: {type(e).__name__}: {e}")
        self.groups[name] = group
        self.staged.clear()  # a new group starts a new push
        return _reply(True, f"Succeeded to init group {name} as rank {group.rank} of {group.world_size}.")

    async def update(self, body: dict) -> JSONResponse:
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not all(isinstance(x, list) for x in (names, dtypes, shapes)):
            raise ProtocolError("update_weights_from_distributed: names, dtypes and shapes (lists) are required")
        name = str(body.get("group_name", "weight_update_group"))
        group = self.groups.get(name)
        if group is None:
            return _reply(False, f"update_weights_from_distributed: no weight group {name!r} (init it first)")
        refused = self.refuse_flush("update_weights_from_distributed", body)
        try:
            check_announced(self.spec, names, dtypes, shapes, "update_weights_from_distributed")
        except EngineError as e:  # nothing received: the push is over, and the trainer's broadcast fails now
            refused = _reply(False, str(e))
        if refused is not None:
            self.close(name)
            self.staged = {}
            return refused
        async with self.update_lock:
            if body.get("abort_all_requests"):
                await self.engine.abort()
            try:
                self.staged.update(await asyncio.to_thread(receive, group, names, dtypes, shapes))
            except Exception as e:  # noqa: BLE001  (a peer gone or the timeout: this group is done)
                self.close(name)
                self.staged = {}
                return _reply(False, f"Failed to receive the weights: {type(e).__name__}: {e}")
            if self.spec.missing(self.staged):
                return _reply(True, f"Received {len(self.staged)} of {len(self.spec.shapes)} tensors.")
            staged, self.staged = self.staged, {}  # loaded or refused whole: the next push starts afresh
            version = self.engine.get_version() + 1
            try:
                await self.engine.update_weights(staged, version=version)
            except EngineError as e:  # checked before any weight changed: the old weights and version stay
                return _reply(False, str(e))
            self.name_version(version, body.get("weight_version"))
        return _reply(True, "Succeeded to update parameter online from distributed.")

    async def destroy(self, body: dict) -> JSONResponse:
        name = str(body.get("group_name", "weight_update_group"))
        if name not in self.groups:
            return _reply(False, f"no weight group {name!r}")
        self.close(name)
        return _reply(True, f"Succeeded to destroy group {name}.")

    def close(self, name: str | None = None) -> None:
        """Leave group ``name`` (None: every group)."""
        for key in list(self.groups) if name is None else [name]:
            group = self.groups.pop(key, None)
            if group is not None:
                group.close()


def _reply(success: bool, message: str) -> JSONResponse:
    """SGLang's reply shape: 200 with success true, 400 with success false."""
    return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)
