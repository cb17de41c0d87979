"""`RemoteEngine`: what every client of remote inference servers shares (`SGLangEngine`, `VLLMEngine`).

Requests go round-robin over the servers, with episode stickiness: requests whose rid shares the prefix
before the last ``/`` (``episode7/t0``, ``episode7/t1``) go to the same server, so its prefix cache
holds the conversation. Each token's version comes from the server's ``weight_versions`` spans (names
the client set, mapped back to ints). A weight update pauses every server, loads the weights, names the
new version and resumes. With ``pause_mode="abort"`` in-flight requests come back ``abort`` with their
tokens so far and are resubmitted as prompt + tokens so far with the remaining budget (AReaL's partial
rollouts); with ``"keep"`` they wait inside the server and go on with the new weights (PipelineRL's in-flight
update), and the spans say where the version changed.

Retries: connection errors, client timeouts and 5xx replies are retried with exponential backoff; after
``max_retries`` the request fails with `EngineError`. Errors the server would repeat are not retried and
raise at once with the server's message: a 4xx (bad input; 408 and 429 excepted), a 501, and a 500 from a
server whose ``/health`` answers 200 (the request itself fails there). Every generate attempt carries a
fresh server-side request id (the ``rid`` plus ``#`` and a random suffix), and an attempt given up on
(client timeout, dropped connection, cancelled caller) is aborted on its server, so it does not keep
generating beside its retry.

A subclass says how its servers' API spells these things: the generate route, its body and reply, the
request-id key, abort, pause and resume, loading weights from a directory, and naming a version; and, for
LoRA adapters (`RemoteLora`: loaded as a weight update, requests naming theirs), loading and unloading one.

Rotation: a server taken out (`take_out`, e.g. by `BroadcastSync` when it failed a push) gets no new
requests, nor pauses and weight loads, until `put_back`; its episodes move to the others. Weights a
broadcast pushed are lost when a server restarts, so after `guard_restarts` a server that stops answering a
generate, or that the launcher's `Supervisor` restarted, leaves the rotation until a push reaches it again.

An admin key (``admin_key``, else ``AREAL_ADMIN_KEY``) goes with every request, for serve-model's control routes
(`engines.server_control`); a server whose /health says paused counts as healthy (alive: updates pause them all).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import itertools
import json
import secrets
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import aiohttp

from areal_agents.engines.base import LoraEngine
from areal_agents.engines.interruptible import ResumeGate, generate_to_end, update_pause
from areal_agents.engines.remote_lora import PauseMode, RemoteLora
from areal_agents.engines.server_control import admin_headers, admin_key_from_env, health_state
from areal_agents.engines.server_metrics import MetricNames, ServerMetrics
from areal_agents.engines.weight_sync import DiskSync, StateDictSource
from areal_agents.errors import EngineError, RequestError
from areal_agents.timeline import Timeline, timeline
from areal_agents.types import GenRequest, GenResponse


class ServerError(EngineError):
    """A server replied with an error status (``status``) or could not be reached (``status`` None)."""

    def __init__(self, url: str, status: int | None, message: str) -> None:
        super().__init__(f"{url}: {message}" if status is None else f"{url}: HTTP {status}: {message}")
        self.url, self.status = url, status


class ServerLost(EngineError):
    """A server left the rotation while a request was on it (the request moves to another server)."""


@dataclass
class GenerateReply:
    """What a client takes from one generate reply."""

    rid: str
    tokens: list[int]
    logprobs: list[float]
    finish: str  # stop | length | abort
    versions: list[str | None]  # the weight_version of each token (None: the server did not say)
    message: str = ""


class RemoteEngine(RemoteLora, LoraEngine, abc.ABC):
    """An `InferenceEngine` over HTTP servers; see the module docstring. Subclasses fill in the API."""

    GENERATE_PATH: ClassVar[str]
    RID_KEY: ClassVar[str]  # the generate body's request-id field
    METRICS: ClassVar[MetricNames]  # its /metrics names of running and waiting requests (the run's timeline)

    def __init__(
        self,
        addresses: list[str],
        *,
        weights_dir: str | None = None,
        request_timeout_s: float = 3600.0,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        version: int = 0,
        max_sticky_episodes: int = 100_000,
        pause_mode: PauseMode = "abort",
        admin_key: str | None = None,
    ) -> None:
        if not addresses:
            raise EngineError(f"{type(self).__name__} needs at least one server address")
        if pause_mode not in ("abort", "keep"):
            raise EngineError(f"pause_mode must be 'abort' or 'keep', got {pause_mode!r}")
        self.addresses = [a.rstrip("/") if "://" in a else f"http://{a.rstrip('/')}" for a in addresses]
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.request_timeout_s, self.max_retries, self.backoff_s = request_timeout_s, max_retries, backoff_s
        self.pause_mode: PauseMode = pause_mode
        self.pausing: PauseMode = pause_mode  # the mode of the pause in progress (`pause`)
        self._version = version
        self._names: dict[str, int] = {}  # weight_version strings the servers report -> our int versions
        self._round_robin = itertools.cycle(range(len(self.addresses)))
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._max_sticky = max_sticky_episodes
        self._gate = ResumeGate()  # paused by a weight update: requests wait for resume
        self._session: aiohttp.ClientSession | None = None
        self._update_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = collections.Counter()
        self.out: dict[int, str] = {}  # servers out of the rotation -> why
        self._guard = False  # `guard_restarts`: a server that stops answering leaves the rotation
        self._supervisor: Any = None  # a `Supervisor` whose restarts take servers out, after `guard_restarts`
        self._restarts_seen = 0
        self.adapters: dict[str, str] = {}  # LoRA adapters this client loaded: name -> directory
        self.admin_key = admin_key_from_env(admin_key)  # sent with every request (the control routes want it)
        tl = timeline()  # in a run that records its timeline: each server's queues, polled from its /metrics
        self._metrics = ServerMetrics(self.addresses, self.METRICS, tl) if isinstance(tl, Timeline) else None

    # ---- what a subclass says about its servers' API -------------------------------------------

    @abc.abstractmethod
    def generate_body(self, request: GenRequest) -> dict[str, Any]:
        """The generate route's body for ``request``."""

    @abc.abstractmethod
    def read_reply(self, reply: Any) -> GenerateReply:
        """The generate route's reply read; a `ValueError` if it lacks what the client needs."""

    @abc.abstractmethod
    async def pause_servers(self) -> None:
        """Pause every server (``self.pause_mode``: abort in-flight requests or keep them)."""

    @abc.abstractmethod
    async def resume_servers(self) -> None:
        """Resume every server."""

    @abc.abstractmethod
    async def load_on_servers(self, model_path: str, version: int) -> None:
        """Have every (paused) server load the weights in ``model_path`` and name them ``version``."""

    @abc.abstractmethod
    async def name_version_on_servers(self, version: int) -> None:
        """Have every server name its weights ``version`` (no new weights)."""

    @abc.abstractmethod
    async def abort_on_server(self, url: str, rid: str) -> None:
        """Ask ``url`` to stop the request whose server-side id is ``rid``."""

    # ---- the InferenceEngine protocol -----------------------------------------------------------

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    async def announce_version(self) -> None:
        """Have every server tag its tokens with this client's version (a resumed run's servers start
        as "default", and clients in other processes read versions from the servers)."""
        await self.name_version_on_servers(self._version)
        self._names[str(self._version)] = self._version

    async def agenerate(self, request: GenRequest) -> GenResponse:
        """Generate to the end: resubmitted after every abort (`generate_to_end`)."""
        return await generate_to_end(request, self._generate_part, self._gate)

    async def _generate_part(self, request: GenRequest) -> GenResponse:
        """``request`` on its server until it finishes or is aborted (a pause); rerouted when its server is
        lost, its adapter loaded again (once) when a restarted server lost it."""
        restored = False
        while True:
            url = self.addresses[self._server_for(request.rid)]
            submitted_version = self._version
            try:
                reply = await self._post(url, self.GENERATE_PATH, self.generate_body(request), rid=request.rid)
            except ServerLost:
                self.stats["rerouted"] += 1
                await self._gate.wait()
                continue  # to another server
            except RequestError as e:
                if restored or not await self.restore_adapter(url, request.lora_name, e):
                    raise
                restored = True
                continue
            try:
                part = self.read_reply(reply)
            except ValueError as e:
                raise EngineError(f"{url}{self.GENERATE_PATH}: {e}") from e
            self.stats["requests"] += 1
            self.stats["resubmitted"] += part.finish == "abort"
            versions = [self._to_int(v, submitted_version) for v in part.versions]
            return GenResponse(part.tokens, part.logprobs, versions, part.finish)

    async def pause(self, mode: PauseMode | None = None) -> None:
        """Pause every server; new requests wait here for `resume` (in-flight ones: ``mode``, by default
        ``pause_mode``; `pause_servers` reads it as ``self.pausing``)."""
        self._gate.pause()
        self.pausing = mode or self.pause_mode
        await self.pause_servers()

    async def resume(self) -> None:
        await self.resume_servers()
        self._gate.resume()

    def flush_with_update(self) -> bool:
        """Whether a weight update in the pause in progress asks the servers to flush their cache (SGLang's
        ``flush_cache``): after an abort pause, yes (nothing is pending, so the flush is valid, and no prefix
        keeps KV of the old weights); with ``keep`` no: the requests an ``in_place`` pause keeps are pending,
        SGLang's flush fails on them and its scheduler asserts. They go on with the KV cache they have, as
        PipelineRL's in-flight update does (docs/sglang.md), and no later point is valid while requests run."""
        return self.pausing == "abort"

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None) -> None:
        """Write ``state_dict`` as safetensors under ``weights_dir`` and have every server load it (the
        disk push, `DiskSync`)."""
        await DiskSync([self]).push(StateDictSource(state_dict), version)

    def weights_path(self, version: int) -> Path:
        """Where the weights of ``version`` are written for the servers to load."""
        if self.weights_dir is None:
            raise EngineError(
                f"{type(self).__name__}.update_weights needs weights_dir (a directory the servers can read)"
            )
        return self.weights_dir / f"v{version}"

    def prune_weights(self, version: int) -> None:
        """Delete written weights older than the version before ``version``."""
        for old in self.weights_path(version).parent.glob("v*"):
            if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
                shutil.rmtree(old, ignore_errors=True)

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None:
        """Pause all servers, load ``model_path`` on each, name the new version, resume."""
        await self.swap_weights(lambda v: self.load_on_servers(model_path, v), version)

    async def swap_weights(
        self, load: Callable[[int], Awaitable[None]], version: int | None = None, pause_mode: PauseMode | None = None
    ) -> None:
        """One weight update, however the weights travel: under the update lock, pause the servers
        (``pause_mode``: this pause's, default ``self.pause_mode``), ``await load(version)``, take ``version``
        (default: the current + 1), resume (unless they were paused before)."""
        self._ensure_primitives()
        version = self._version + 1 if version is None else version
        async with self._update_lock, update_pause(self._gate, lambda: self.pause(pause_mode), self.resume):
            await load(version)
            self._names[str(version)] = version
            self._version = version

    def in_rotation(self) -> list[int]:
        """The servers that take requests (every one not taken out), by index in ``addresses``."""
        self._note_restarts()
        return [i for i in range(len(self.addresses)) if i not in self.out]

    def take_out(self, index: int, reason: str) -> None:
        """Send no more requests, pauses or weight loads to server ``index`` until `put_back`."""
        if index not in self.out:
            self.stats["taken_out"] += 1
        self.out[index] = reason
        for episode in [e for e, i in self._sticky.items() if i == index]:
            del self._sticky[episode]  # its episodes continue elsewhere

    def put_back(self, index: int) -> None:
        """Server ``index`` takes requests again (it serves the current weights)."""
        self.out.pop(index, None)

    def guard_restarts(self, supervisor: Any = None) -> None:
        """From now on a server that stops answering a generate leaves the rotation, and so does one that
        ``supervisor`` (the launcher's `Supervisor`) restarts: it lost the weights pushed to it."""
        self._guard, self._supervisor = True, supervisor
        self._restarts_seen = len(supervisor.restarts) if supervisor is not None else 0

    async def post_once(self, url: str, path: str, body: dict | None, timeout_s: float) -> Any:
        """One POST to ``url`` without retries, with its own timeout: the reply's JSON, or an error
        (`ServerError`; `RequestError` for a 4xx, as `_post`)."""
        try:
            return await self._post_once(url, path, body, None, timeout_s)
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
            raise ServerError(url, None, f"{type(e).__name__}: {e}") from e

    async def healthy(self, index: int) -> bool:
        """Whether server ``index`` answers /health now (no retries)."""
        return await self._healthy(self.addresses[index])

    async def health(self) -> list[bool]:
        """Whether each server answers /health now (no retries)."""
        return list(await asyncio.gather(*(self._healthy(u) for u in self.addresses)))

    async def aclose(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- internals ----------------------------------------------------------------------------

    def _server_for(self, rid: str) -> int:
        rotation = self.in_rotation()
        if not rotation:
            reasons = "; ".join(f"{self.addresses[i]}: {why}" for i, why in self.out.items())
            raise EngineError(f"every server is out of the rotation until a weight push reaches it ({reasons})")
        episode = rid.rsplit("/", 1)[0]
        if episode in self._sticky:
            self._sticky.move_to_end(episode)
            return self._sticky[episode]
        index = next(self._round_robin)
        while index in self.out:
            index = next(self._round_robin)
        self._sticky[episode] = index
        if len(self._sticky) > self._max_sticky:
            self._sticky.popitem(last=False)
        return index

    def _note_restarts(self) -> None:
        """Take out the servers the supervisor restarted since the last look (after `guard_restarts`)."""
        if self._supervisor is None or len(self._supervisor.restarts) == self._restarts_seen:
            return
        restarts, addresses = list(self._supervisor.restarts), self._supervisor.group.addresses
        for restart in restarts[self._restarts_seen :]:
            url = addresses[restart.index].rstrip("/")
            if url in self.addresses:
                self.take_out(self.addresses.index(url), f"restarted ({restart.reason}): it lost the pushed weights")
        self._restarts_seen = len(restarts)

    def _to_int(self, name: str | None, default: int) -> int:
        if name is None:
            return default
        if name in self._names:
            return self._names[name]
        try:
            return int(name)
        except ValueError:
            return default  # e.g. the servers' initial "default"

    def _ensure_primitives(self) -> None:
        """asyncio primitives for the running loop (a second asyncio.run gets fresh ones)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._update_lock = asyncio.Lock()
            self._session = None  # bound to the old loop

    def _client(self) -> aiohttp.ClientSession:
        self._ensure_primitives()
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), headers=admin_headers(self.admin_key)
            )
        return self._session

    async def _all(self, path: str, body: dict | None, params: dict | None = None, *, text: bool = False) -> list[Any]:
        """POST to every server in the rotation; their replies in that order (``text``: the replies are
        plain text, e.g. vLLM's adapter routes)."""
        urls = [self.addresses[i] for i in self.in_rotation()]
        return list(await asyncio.gather(*(self._post(url, path, body, params=params, text=text) for url in urls)))

    async def _post(
        self,
        url: str,
        path: str,
        body: dict | None,
        rid: str | None = None,
        params: dict | None = None,
        text: bool = False,
    ) -> Any:
        """POST with retries on connection errors, timeouts and transient 5xx; errors the server would
        repeat raise at once (see the module docstring). With ``rid``, each attempt sends a fresh
        ``rid#suffix`` and one given up on is aborted on the server."""
        delay = self.backoff_s
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if rid is not None:
                body = {**body, self.RID_KEY: f"{rid}#{secrets.token_hex(4)}"}
            try:
                return await self._post_once(url, path, body, params, text=text)
            except ServerError as e:
                last = e
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
                last = ServerError(url, None, f"{type(e).__name__}: {e}")
                if rid is not None:  # it may still be running there
                    await self._abort(url, body[self.RID_KEY])
                if rid is not None and self._guard and url in self.addresses:
                    self.take_out(self.addresses.index(url), f"stopped answering: {last}")
                    raise ServerLost(str(last)) from e
            except asyncio.CancelledError:
                if rid is not None:
                    await self._abort(url, body[self.RID_KEY])
                raise
            if attempt < self.max_retries:
                self.stats["retries"] += 1
                await asyncio.sleep(delay)
                delay *= 2
        raise EngineError(f"{url}{path} failed after {self.max_retries + 1} attempts: {last}")

    async def _post_once(
        self,
        url: str,
        path: str,
        body: dict | None,
        params: dict | None,
        timeout_s: float | None = None,
        text: bool = False,
    ) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.request_timeout_s)
        async with self._client().post(f"{url}{path}", json=body, params=params, timeout=timeout) as r:
            reply = await r.text()
            if r.status >= 400:
                message = _message(reply)
                if not await self._transient(url, r.status):
                    refused = RequestError if 400 <= r.status < 500 else EngineError  # the request itself
                    raise refused(f"{url}{path}: HTTP {r.status}: {message}{_NOT_RETRIED.get(r.status, '')}")
                raise ServerError(url, r.status, message)
            if text:
                return reply
            if not reply.strip():
                return {}
            try:
                return json.loads(reply)
            except ValueError as e:
                raise ServerError(url, r.status, f"reply is not JSON: {reply[:200]}") from e

    async def _transient(self, url: str, status: int) -> bool:
        """Whether an error reply may go away on a retry: not a 4xx (but 408, 429), not a 501, and not a
        500 from a server that is healthy (the request itself fails there and would again)."""
        if status in (408, 429):
            return True
        if status < 500 or status == 501:
            return False
        if status == 500:
            return not await self._healthy(url)
        return True

    async def _healthy(self, url: str) -> bool:
        """Whether ``url``'s /health says it is up: ok, or paused on purpose (`health_state`)."""
        try:
            async with self._client().get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return r.status == 200 or health_state(r.status, await r.json(content_type=None)) == "paused"
        except (TimeoutError, aiohttp.ClientError, ConnectionError, ValueError):
            return False

    async def _abort(self, url: str, rid: str) -> None:
        """Best effort: stop request ``rid`` on ``url`` (shielded from the caller's cancellation)."""
        try:
            await asyncio.shield(asyncio.wait_for(self.abort_on_server(url, rid), timeout=5))
            self.stats["aborted"] += 1
        except (TimeoutError, aiohttp.ClientError, ConnectionError, asyncio.CancelledError):
            pass  # the server is gone, or the caller is cancelled again: nothing more to do

    async def _post_quick(self, url: str, path: str, body: dict) -> None:
        """One POST without retries (aborts), its reply read and dropped."""
        timeout = aiohttp.ClientTimeout(total=5)
        async with self._client().post(f"{url}{path}", json=body, timeout=timeout) as r:
            await r.read()


_NOT_RETRIED = {500: " (not retried: the server is healthy, so the request itself fails there)"}


def _message(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "error_message"):  # the second: SGLang's LoRA routes (LoRAUpdateOutput)
            if body.get(key):
                return str(body[key])
    return text[:300]
