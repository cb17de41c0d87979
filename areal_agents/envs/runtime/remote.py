"""`RemoteEnvPool` / `RemoteEnv`: the `AsyncEnv` interface over the env-step server's HTTP API.

One pooled ``aiohttp.ClientSession`` serves every session (aiohttp rather than httpx: more
requests/s at hundreds of concurrent sessions; docs/benchmarks.md). Steps issued in the same event-loop tick by
different sessions of one server are coalesced into one ``POST /v1/step`` (``batch_steps=True``), which
is what lets thousands of concurrent episodes share a server cheaply.

A multi-agent env speaks protocol v2: on a server whose /health lists v2 (asked once per server), sessions are
created with ``POST /v2/sessions``, whose reply says whether the env is multi-agent; a multi-agent session is
stepped with a dict of actions over ``/v2`` (batched like v1's) and its env's ``acting`` says who acts next; a
single-agent one keeps v1's steps. ``owner`` tags a run's sessions, so ``close_sessions`` (or `close_owned`
after a crash) closes them all on every server.

Several servers (replicas): new sessions go round-robin to those that answer; a session stays on its
server. A server lost mid-episode ends that episode as an env failure (``server_lost``, retried by the
rollout controller); ``resolve`` (optional) gives the current addresses, e.g. of restarted Ray actors.

    pool = RemoteEnvPool("http://127.0.0.1:8765")
    env = pool.make("areal_agents/Arithmetic-v0", digits=2)
    obs, info = await env.areset(seed=0)
    obs, reward, terminated, truncated, info = await env.astep("42")
    await env.aclose(); await pool.aclose()
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from areal_agents.envs.runtime.protocol import OWNER_PATTERN, SINGLE_AGENT
from areal_agents.envs.runtime.server_process import EnvServerProcess  # re-exported: where clients import it
from areal_agents.errors import ArealAgentsError, EnvError, RunHalted, UnknownEnvError
from areal_agents.timeline import timeline

_EPISODE_ERRORS = ("env_error", "timeout", "worker_died")
# a batched step's failed item carries its error type, not a status: the status its single step answers
_ITEM_STATUS = {"unknown_session": 404, "episode_over": 409, "session_busy": 409}
_BATCH_BYTES = 1 << 20  # a batched step's actions per request: far under serve-env's default body limit (8 MiB)


class EnvServerError(ArealAgentsError):
    """The server refused a request (4xx/5xx) or could not be reached; ``type`` is its error type."""

    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(f"env server: {type_} ({status}): {message}")
        self.status, self.type, self.detail = status, type_, message


class EnvRequestRefused(EnvServerError, RunHalted):
    """A 4xx for the run's own request (its kwargs, actions or steps): sending it again gets the same answer,
    so the run stops at once with the server's status and message rather than failing every episode."""


class EnvServerUnreachable(RunHalted):
    """No env server answered for longer than the pool's ``unreachable_timeout_s``: the run stops."""


@dataclass
class _Reply:
    status: int
    body: Any
    text: str


def _error(status: int, type_: str, message: str) -> Exception:
    """The exception a refusal stands for: an env failure of the episode (the env failed, the server erred
    with a 5xx, lost the session or stayed full: retried), or the run's own mistake (other 4xx: `EnvRequestRefused`)."""
    if type_ == "unknown_env":
        return UnknownEnvError(message)
    if type_ in _EPISODE_ERRORS:
        return EnvError(type_, message)
    if status >= 500:
        return EnvError("server_error", f"{type_} ({status}): {message}")
    if type_ == "unknown_session":
        return EnvError("session_lost", message)  # expired or its server restarted: the episode is lost
    if status == 429:
        return EnvError("server_full", message)  # still at its session cap after the pool's timeout
    return EnvRequestRefused(status, type_, message)


def _raise_for(response: _Reply) -> dict[str, Any]:
    body = response.body
    if response.status >= 400:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        err = err if isinstance(err, dict) else {}
        raise _error(response.status, err.get("type", "http_error"), err.get("message", response.text[:200]))
    return body


def _raise_item_error(result: dict[str, Any]) -> None:
    err = result.get("error")
    if err:
        raise _error(_ITEM_STATUS.get(err["type"], 400), err["type"], err["message"])


def _step_tuple(result: dict[str, Any]) -> tuple[str, float, bool, bool, dict[str, Any]]:
    _raise_item_error(result)
    return result["observation"], result["reward"], result["terminated"], result["truncated"], result["info"]


def _check_owner(owner: str | None) -> None:
    if owner is not None and not re.fullmatch(OWNER_PATTERN, owner):
        raise ArealAgentsError(f"owner: expects 1 to 128 characters of [A-Za-z0-9_.:-], got {owner!r}")


def _chars(action: str | dict[str, str]) -> int:
    return len(action) if isinstance(action, str) else sum(len(a) + len(x) + 8 for a, x in action.items())


def _by_size(items: list[tuple[str, Any, Any]], limit: int) -> list[list[tuple[str, Any, Any]]]:
    """``(session_id, action or actions, ...)`` items in batches of at most ``limit`` characters of actions and
    ids (one item alone may be more): many long actions together must not pass a server's body limit (413)."""
    batches: list[list[tuple[str, Any, Any]]] = [[]]
    size = 0
    for item in items:
        n = len(item[0]) + _chars(item[1]) + 32
        if batches[-1] and size + n > limit:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += n
    return batches


class RemoteEnv:
    """One episode at a time on the server; ``areset`` opens a session (closing the previous one).

    ``multi_agent``, ``agents`` and ``acting`` are known once a session is open (a v2 server's create reply);
    ``acting`` is None for a single-agent env."""

    def __init__(self, pool: RemoteEnvPool, env_id: str, kwargs: dict[str, Any]) -> None:
        self.pool, self.env_id, self.kwargs = pool, env_id, kwargs
        self.session_id: str | None = None
        self.server: str = ""  # the address of the server holding the session
        self.multi_agent = False
        self.agents: list[str] = []
        self.acting: list[str] | None = None

    async def areset(self, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        with self.pool.counted(), timeline().span("episodes", "env_reset", env=self.env_id) as span:
            result = await self._reset(seed, options)
            span["server"] = self.server
            return result

    async def _reset(self, seed: int | None, options: dict | None) -> tuple[Any, dict]:
        await self.aclose()
        body = {"env_id": self.env_id, "kwargs": self.kwargs, "seed": seed, "options": options}
        try:
            self.server, reply, v2 = await self.pool._create(body)
        except EnvServerError as e:  # no server answered: an env failure, retried
            raise EnvError("unreachable", e.detail) from None
        created = _raise_for(reply)
        self.session_id = created["session_id"]
        self.pool._held(self.server).add(self.session_id)
        if not v2:
            return created["observation"], created["info"]
        self.multi_agent = bool(created["multi_agent"])
        if not self.multi_agent:
            return created["observations"][SINGLE_AGENT], created["infos"].get(SINGLE_AGENT, {})
        self.agents, self.acting = list(created["agents"]), list(created["acting"])
        return created["observations"], created["infos"]

    async def astep(self, action: Any) -> tuple[Any, Any, Any, Any, Any]:
        """A text action (single-agent) or a dict of one action per acting agent (multi-agent: over v2)."""
        if self.session_id is None:
            raise ArealAgentsError("RemoteEnv.astep() before areset()")
        with self.pool.counted(), timeline().span("episodes", "env_step", env=self.env_id, server=self.server):
            return await self._astep(action)

    async def _astep(self, action: Any) -> tuple[Any, Any, Any, Any, Any]:
        try:
            if self.multi_agent:
                return self._follow(await self._step("/v2", {"actions": action}, action))
            return _step_tuple(await self._step("/v1", {"action": action}, action))
        except EnvServerError as e:
            if e.type != "unreachable":
                raise
            self._lost()
            raise EnvError("server_lost", e.detail) from None  # the session went with its server
        except EnvError:
            self._lost()  # the server already closed it
            raise

    async def _step(self, version: str, body: dict[str, Any], action: Any) -> dict[str, Any]:
        if self.pool.batch_steps:
            return await self.pool._batched_step(self.server, version, self.session_id, action)
        url = f"{self.server}{version}/sessions/{self.session_id}/step"
        return _raise_for(await self.pool._request("POST", url, body))

    def _follow(self, result: dict[str, Any]) -> tuple[Any, Any, Any, Any, Any]:
        _raise_item_error(result)
        self.acting = list(result["acting"])
        keys = ("observations", "rewards", "terminations", "truncations", "infos")
        return tuple(result[k] for k in keys)

    def _lost(self) -> None:
        if self.session_id is not None:
            self.pool._held(self.server).discard(self.session_id)
        self.session_id = None
        if self.multi_agent:
            self.acting = []

    async def aclose(self) -> None:
        if self.session_id is None:
            return
        sid = self.session_id
        self._lost()
        try:
            response = await self.pool._request("DELETE", f"{self.server}/v1/sessions/{sid}")
        except EnvServerError as e:
            if e.type == "unreachable":
                return  # the server is gone, and the session with it
            raise
        if response.status != 404:  # already expired or closed is fine
            _raise_for(response)


class RemoteEnvPool:
    """Sessions on one or more env-step servers, sharing a connection pool and a step batcher."""

    def __init__(
        self,
        base_url: str | list[str],
        *,
        timeout: float = 120.0,
        max_connections: int = 64,
        batch_steps: bool = True,
        resolve: Callable[[], Awaitable[list[str]]] | None = None,
        unreachable_timeout_s: float = 30.0,
        owner: str | None = None,
    ) -> None:
        """``unreachable_timeout_s``: once no server has answered for this long, a request that finds none
        raises `EnvServerUnreachable` (the run stops) instead of failing its episode (retried). ``owner``: the
        run's name, sent with every session created on a v2 server (1..128 of ``[A-Za-z0-9_.:-]``)."""
        _check_owner(owner)
        self.owner = owner
        self._v2: dict[str, bool] = {}  # per server: its /health lists v2
        self._open: dict[str, set[str]] = {}  # per server: the sessions this pool holds
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ArealAgentsError("RemoteEnvPool needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.base_url = self.urls[0]
        self.batch_steps = batch_steps
        self.timeout = timeout
        self.max_connections = max_connections
        self.resolve = resolve
        self.unreachable_timeout_s = unreachable_timeout_s
        self._unreachable_since: float | None = None  # the first unanswered request since the last answer
        self._refreshing: asyncio.Future | None = None
        self._next = 0
        self._client: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[tuple[str, str], list[tuple[str, Any, asyncio.Future]]] = {}
        self.in_flight = 0  # resets and steps waiting on a server
        timeline().gauge("env/steps_in_flight", lambda: self.in_flight)

    @contextmanager
    def counted(self) -> Iterator[None]:
        """A reset or step is in flight (the timeline's ``env/steps_in_flight``)."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    @property
    def client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:  # a client is bound to its event loop
            self._client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            )
            self._loop = loop
        return self._client

    async def _request(self, method: str, url: str, body: Any = None) -> _Reply:
        try:
            async with self.client.request(method, url, json=body) as response:
                text = await response.text()
                try:
                    parsed = json.loads(text) if text else {}
                except ValueError:
                    parsed = {}
            self._unreachable_since = None
            return _Reply(response.status, parsed, text)
        except (aiohttp.ClientError, TimeoutError) as e:
            reason = f"{url}: {type(e).__name__}: {e}"
        now = time.monotonic()
        since = self._unreachable_since = self._unreachable_since or now
        if now - since > self.unreachable_timeout_s:
            raise EnvServerUnreachable(
                f"no env server answered for {now - since:.0f}s (env.unreachable_timeout_s="
                f"{self.unreachable_timeout_s:g}); last: {reason}"
            )
        raise EnvServerError(0, "unreachable", reason)

    def make(self, env_id: str, **kwargs: Any) -> RemoteEnv:
        return RemoteEnv(self, env_id, kwargs)

    def _held(self, server: str) -> set[str]:
        return self._open.setdefault(server, set())

    async def speaks_v2(self, server: str) -> bool:
        """Whether ``server`` serves protocol v2 (its /health lists it); asked once per server."""
        if server not in self._v2:
            reply = await self._request("GET", f"{server}/health")
            if reply.status >= 500:  # it cannot say now: an env failure of this episode (retried), nothing kept
                raise EnvError("server_error", f"{server}/health answered {reply.status}: {reply.text[:200]}")
            protocols = reply.body.get("protocols", []) if isinstance(reply.body, dict) else []
            self._v2[server] = reply.status == 200 and isinstance(protocols, list) and "v2" in protocols
        return self._v2[server]

    async def _create(self, body: dict[str, Any]) -> tuple[str, _Reply, bool]:
        """Open a session, waiting while every server is at its session cap (429 too_many_sessions): a run may
        want more episodes at once than a server takes, and each episode frees its place when it ends. Gives
        the last 429 after ``timeout`` seconds of waiting."""
        deadline = asyncio.get_running_loop().time() + self.timeout
        pause = 0.02
        while True:
            server, reply, v2 = await self._create_once(body)
            if reply.status != 429 or asyncio.get_running_loop().time() + pause > deadline:
                return server, reply, v2
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)

    async def _create_once(self, body: dict[str, Any]) -> tuple[str, _Reply, bool]:
        """Open a session on the next server that answers and has room; (its address, the reply, whether it
        was made over v2: every session on a v2 server is, so its reply says if the env is multi-agent). When one
        does not answer, the addresses are re-resolved in the background (a restarted replica rejoins); when
        none does, this waits for that."""
        error: EnvServerError | None = None
        full: tuple[str, _Reply, bool] | None = None
        for attempt in range(2 if self.resolve else 1):
            if attempt:
                await self._refresh()
            for _ in range(len(self.urls)):
                server = self.urls[self._next % len(self.urls)]
                self._next += 1
                try:
                    v2 = await self.speaks_v2(server)
                    owned = {**body, "owner": self.owner} if v2 and self.owner else body
                    reply = await self._request("POST", f"{server}/{'v2' if v2 else 'v1'}/sessions", owned)
                    if reply.status != 429:
                        return server, reply, v2
                    full = server, reply, v2  # at its cap: try the next replica
                except EnvServerError as e:
                    error = e  # unreachable: try the next replica
                    if self.resolve:
                        self._refresh_soon()
            if full is not None:
                return full
        raise error

    def _refresh_soon(self) -> None:
        """Re-resolve the addresses in the background (one refresh at a time)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._resolve())
            self._refreshing.add_done_callback(lambda t: t.cancelled() or t.exception())  # read by _refresh

    async def _resolve(self) -> None:
        self.urls = [u.rstrip("/") for u in await self.resolve()]

    async def _refresh(self) -> None:
        self._refresh_soon()
        await asyncio.shield(self._refreshing)

    async def _batched_step(self, server: str, version: str, sid: str, action: Any) -> dict[str, Any]:
        """One step, sent with the other steps of this tick to the same server and protocol version."""
        future = asyncio.get_running_loop().create_future()
        key = (server, version)
        pending = self._pending.setdefault(key, [])
        pending.append((sid, action, future))
        if len(pending) == 1:  # the first of this tick: flush after the others have joined
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._flush(key)))
        return await future

    async def _flush(self, key: tuple[str, str]) -> None:
        pending = self._pending.pop(key, [])
        await asyncio.gather(*(self._send(*key, batch) for batch in _by_size(pending, _BATCH_BYTES)))

    async def _send(self, server: str, version: str, batch: list[tuple[str, Any, asyncio.Future]]) -> None:
        field = "action" if version == "/v1" else "actions"
        body = {"steps": [{"session_id": sid, field: action} for sid, action, _ in batch]}
        try:
            results = _raise_for(await self._request("POST", f"{server}{version}/step", body))["results"]
        except Exception as e:
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        for (_, _, fut), result in zip(batch, results):
            if not fut.done():
                fut.set_result(result)

    async def list_envs(self) -> list[dict[str, str]]:
        return _raise_for(await self._request("GET", f"{self.base_url}/v1/envs"))["envs"]

    async def metrics(self) -> dict[str, Any]:
        return _raise_for(await self._request("GET", f"{self.base_url}/metrics"))

    async def health(self) -> dict[str, Any]:
        return _raise_for(await self._request("GET", f"{self.base_url}/health"))

    async def close_sessions(self) -> int:
        """Close every session this pool still holds: by owner on every v2 server it used (one request closes
        the run's sessions there, those it lost track of too: a create or close cancelled mid-request, when
        the run stopped its episodes, may have left one open), one DELETE each otherwise. Never raises for a
        server that does not answer (its sessions went with it, or expire there); returns how many the servers
        closed."""
        closed = 0
        for server in sorted({*self._open, *self._v2}):
            sids = self._held(server)
            by_owner = bool(self.owner) and self._v2.get(server, False)
            if not (sids or by_owner):
                continue
            try:
                if by_owner:
                    reply = await self._request("DELETE", f"{server}/v2/sessions?owner={self.owner}")
                    closed += int(reply.body.get("closed", 0)) if reply.status == 200 else 0
                else:
                    for sid in list(sids):
                        reply = await self._request("DELETE", f"{server}/v1/sessions/{sid}")
                        closed += reply.status == 200
            except (EnvServerError, EnvServerUnreachable):
                pass
            sids.clear()
        return closed

    async def aclose(self) -> None:
        if self._client is not None:
            if self._loop is asyncio.get_running_loop():
                await self._client.close()
            self._client = None


async def close_owned(urls: str | list[str], owner: str, *, timeout: float = 10.0) -> int:
    """Close every session ``owner`` holds on the v2 servers among ``urls`` (a run starting again after it was
    killed); a server that does not answer or speaks only v1 is passed over. Returns how many were closed."""
    _check_owner(owner)
    closed = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as client:
        for url in [urls] if isinstance(urls, str) else urls:
            try:
                async with client.delete(f"{url.rstrip('/')}/v2/sessions", params={"owner": owner}) as response:
                    body = await response.json(content_type=None) if response.status == 200 else {}
                closed += int(body.get("closed", 0)) if isinstance(body, dict) else 0
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
    return closed


__all__ = ["EnvServerError", "EnvServerProcess", "RemoteEnv", "RemoteEnvPool", "close_owned"]
