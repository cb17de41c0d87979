"""The conformance suite's HTTP side: one `Probe` per run (a client, the server's limits, the env under test),
the shape checks every reply goes through, and raw connections for what a well-behaved client never does
(slow clients). The checks themselves are in `conformance` (v1) and `conformance_v2` (multi-agent sessions)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp

STEP_FIELDS = {"session_id": str, "observation": str, "reward": (int, float), "terminated": bool, "truncated": bool}
CREATED_V2_FIELDS = {
    "session_id": str,
    "multi_agent": bool,
    "agents": list,
    "acting": list,
    "observations": dict,
    "infos": dict,
}
STEP_V2_FIELDS = {
    "session_id": str,
    "observations": dict,
    "rewards": dict,
    "terminations": dict,
    "truncations": dict,
    "infos": dict,
    "acting": list,
}
NUMBER = (int, float)


class Violation(Exception):
    """A rule of docs/env-protocol.md that the server broke; the message says which, and what came back."""


class NotTestable(Exception):
    """The rule cannot be checked against this server as configured (the message says why and what to pass)."""


class NotSpoken(NotTestable):
    """The rule belongs to a protocol version the server does not speak (a v1-only server and the v2 rules):
    not checked, and no mark against the server, which conforms to what it speaks."""


@dataclass
class Reply:
    status: int
    body: Any
    text: str
    content_type: str

    def describe(self) -> str:
        return f"HTTP {self.status} {self.text[:300]!r}"


@dataclass
class Probe:
    """What the checks share: the server, the env they play and how, and its reported limits."""

    url: str
    env_id: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)
    action: str = "0"
    max_steps: int = 64
    session_probe_limit: int = 256
    limits: dict[str, Any] = field(default_factory=dict)
    protocols: list[str] = field(default_factory=lambda: ["v1"])  # what /health says the server speaks
    multi_agent_env: str = ""  # the multi-agent env the v2 checks play ("" when there is none to play)
    multi_agent_kwargs: dict[str, Any] = field(default_factory=dict)
    client: aiohttp.ClientSession | None = None
    not_json: list[str] = field(default_factory=list)  # replies whose Content-Type was not JSON
    opened: set[str] = field(default_factory=set)  # sessions the suite created and has not closed

    async def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None) -> Reply:
        """One request; ``raw`` sends those bytes as the body as they are (malformed JSON, oversized bodies)."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {"Content-Type": "application/json"} if data is not None else {}
        async with self.client.request(method, self.url + path, data=data, headers=headers) as response:
            return await self._read(method, path, response)

    async def request_chunked(self, path: str, chunks: AsyncIterator[bytes]) -> Reply:
        """A POST whose body goes with ``Transfer-Encoding: chunked`` (no Content-Length)."""
        headers = {"Content-Type": "application/json"}
        async with self.client.post(self.url + path, data=chunks, headers=headers) as response:
            return await self._read("POST", path, response)

    async def _read(self, method: str, path: str, response: aiohttp.ClientResponse) -> Reply:
        text = await response.text()
        content_type = response.headers.get("Content-Type", "")
        if "application/json" not in content_type and len(self.not_json) < 5:
            self.not_json.append(f"{method} {path} -> {response.status} with Content-Type {content_type!r}")
        try:
            body = json.loads(text) if text else None
        except ValueError:
            body = None
        created = path in ("/v1/sessions", "/v2/sessions")
        if method == "POST" and created and response.status == 200 and isinstance(body, dict):
            self.opened.add(str(body.get("session_id")))
        elif method == "DELETE":
            self.opened.discard(path.rsplit("/", 1)[-1])
        return Reply(response.status, body, text, content_type)

    # -- the requests the checks make most ---------------------------------------------------------

    async def create(self, seed: int | None = 0, **extra: Any) -> dict[str, Any]:
        """Open a session of the env under test; its reply, checked for shape."""
        body = {"env_id": self.env_id, "kwargs": self.kwargs, "seed": seed, **extra}
        reply = await self.request("POST", "/v1/sessions", body)
        created = expect_ok(reply, f"POST /v1/sessions {json.dumps(body)[:200]}")
        check_fields(created, {"session_id": str, "observation": str, "info": dict}, "the created session")
        if not created["session_id"]:
            raise Violation("POST /v1/sessions: session_id is empty")
        return created

    async def step(self, sid: str, action: str | None = None) -> Reply:
        return await self.request(
            "POST", f"/v1/sessions/{sid}/step", {"action": self.action if action is None else action}
        )

    async def step_ok(self, sid: str, action: str | None = None) -> dict[str, Any]:
        result = expect_ok(await self.step(sid, action), f"POST /v1/sessions/{sid}/step")
        check_step_result(result, sid, "the step's reply")
        return result

    async def close(self, sid: str, version: str = "v1") -> Reply:
        return await self.request("DELETE", f"/{version}/sessions/{sid}")

    # -- v2: sessions of several agents -------------------------------------------------------------

    def actions(self, acting: list[str]) -> dict[str, str]:
        """Every acting agent's action: ``action`` each."""
        return {agent: self.action for agent in acting}

    async def create_v2(
        self, seed: int | None = 0, env_id: str = "", kwargs: dict[str, Any] | None = None, **extra: Any
    ) -> dict[str, Any]:
        """Open a v2 session of ``env_id`` (default: the multi-agent env under test); its reply, checked for shape."""
        env_id, kwargs = (env_id, kwargs or {}) if env_id else (self.multi_agent_env, self.multi_agent_kwargs)
        body = {"env_id": env_id, "kwargs": kwargs, "seed": seed, **extra}
        reply = await self.request("POST", "/v2/sessions", body)
        created = expect_ok(reply, f"POST /v2/sessions {json.dumps(body)[:200]}")
        check_created_v2(created, f"the created v2 session of {env_id}")
        return created

    async def step_v2(self, sid: str, actions: dict[str, Any]) -> Reply:
        return await self.request("POST", f"/v2/sessions/{sid}/step", {"actions": actions})

    async def close_owned(self, owner: str) -> Reply:
        return await self.request("DELETE", f"/v2/sessions?owner={quote(owner, safe='')}")

    async def close_leftovers(self) -> None:
        """Closes the sessions that checks which failed midway left open."""
        for sid in list(self.opened):
            await self.close(sid)

    async def sessions_open(self) -> int:
        return expect_ok(await self.request("GET", "/health"), "GET /health")["sessions_open"]


def expect_ok(reply: Reply, what: str) -> Any:
    if reply.status != 200 or not isinstance(reply.body, dict):
        raise Violation(f"{what}: expected 200 with a JSON object, got {reply.describe()}")
    return reply.body


def expect_error(reply: Reply, status: int, type_: str, what: str, names: str = "") -> None:
    """``reply`` refused the request as the protocol says: ``status``, ``{"error": {"type", "message"}}``, and
    a message that names ``names`` when given (the field or key at fault)."""
    error = reply.body.get("error") if isinstance(reply.body, dict) else None
    if reply.status != status or not isinstance(error, dict) or error.get("type") != type_:
        raise Violation(f"{what}: expected {status} with error type {type_!r}, got {reply.describe()}")
    message = error.get("message")
    if not isinstance(message, str) or not message:
        raise Violation(f"{what}: the error has no message: {reply.describe()}")
    if names and names not in message:
        raise Violation(f"{what}: the error message should name {names!r}: {message!r}")


def check_fields(obj: Any, fields: dict[str, Any], what: str) -> None:
    if not isinstance(obj, dict):
        raise Violation(f"{what} is not a JSON object: {obj!r}")
    for key, kind in fields.items():
        if key not in obj:
            raise Violation(f"{what} has no {key!r}: {json.dumps(obj)[:300]}")
        value = obj[key]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise Violation(f"{what}: {key!r} should be {_kind_name(kind)}, got {value!r}")


def check_step_result(result: Any, sid: str, what: str, *, failed: bool = False) -> None:
    """The StepResult shape; ``failed``: a refused batch item (error set, episode over) rather than a normal step."""
    check_result_frame(result, {**STEP_FIELDS, "info": dict}, sid, what, failed)
    if failed and not result["terminated"]:
        raise Violation(f"{what}: a failed step must end the episode (terminated true): {json.dumps(result)}")


def check_result_frame(result: Any, fields: dict[str, Any], sid: str, what: str, failed: bool) -> None:
    """What every step result has, v1 or v2: ``fields``, its session id, and an error: null, or when ``failed``
    a typed record."""
    check_fields(result, fields, what)
    if "error" not in result:
        raise Violation(f"{what} has no 'error' (null for a normal step): {json.dumps(result)[:300]}")
    if result["session_id"] != sid:
        raise Violation(f"{what}: session_id is {result['session_id']!r}, expected {sid!r}")
    if failed:
        check_fields(result["error"], {"type": str, "message": str}, f"{what}'s error")
    elif result["error"] is not None:
        raise Violation(f"{what}: error should be null, got {result['error']!r}")


def trajectory_step(result: dict[str, Any]) -> tuple:
    """What must repeat when an episode is replayed with the same seed and actions."""
    return (result["observation"], float(result["reward"]), result["terminated"], result["truncated"], result["info"])


async def play(
    p: Probe, seed: int, step: Callable[[str], Awaitable[dict]] | None = None, *, keep: bool = False
) -> tuple[str, list]:
    """One v1 episode of ``seed`` to its end: (its session id, its first observation and info, then each step).
    The session is closed after it unless ``keep``."""
    created = await p.create(seed=seed)
    sid, trajectory = created["session_id"], [(created["observation"], created["info"])]
    for _ in range(p.max_steps):
        result = await (step(sid) if step else p.step_ok(sid))
        trajectory.append(trajectory_step(result))
        if result["terminated"] or result["truncated"]:
            if not keep:
                expect_ok(await p.close(sid), "closing a finished session")
            return sid, trajectory
    await p.close(sid)
    raise NotTestable(
        f"an episode did not end within {p.max_steps} steps of action {p.action!r}; pass --action or --max-steps"
    )


# -- v2 shapes -----------------------------------------------------------------------------------------------


def check_created_v2(created: Any, what: str) -> None:
    """A v2 create reply: its agents, who acts first (never nobody) and an observation for each of them."""
    check_fields(created, CREATED_V2_FIELDS, what)
    agents = created["agents"]
    if not agents or not all(isinstance(a, str) and a for a in agents) or len(set(agents)) != len(agents):
        raise Violation(f"{what}: agents should be distinct non-empty strings, got {agents!r}")
    if not created["session_id"]:
        raise Violation(f"{what}: session_id is empty")
    check_acting(created["acting"], agents, what)
    if not created["acting"]:
        raise Violation(f"{what}: acting is empty right after a reset")
    check_per_agent(created["observations"], str, agents, f"{what}'s observations")
    check_per_agent(created["infos"], dict, agents, f"{what}'s infos")
    if missing := [a for a in created["acting"] if a not in created["observations"]]:
        raise Violation(f"{what}: no observation for the acting agents {missing}: {json.dumps(created)[:300]}")


def check_step_result_v2(
    result: Any, sid: str, acted: list[str], agents: list[str], what: str, *, failed: bool = False
) -> None:
    """A MultiStepResult: per-agent dicts over the episode's agents, a reward, termination, truncation and info
    for every agent that ``acted``; ``failed``: a refused batch item (error set, nobody acts next)."""
    check_result_frame(result, STEP_V2_FIELDS, sid, what, failed)
    if failed:
        if result["acting"] != []:
            raise Violation(f"{what}: a failed step must end the episode (acting []): {json.dumps(result)[:300]}")
        return
    check_acting(result["acting"], agents, what)
    for key, kind in (("observations", str), ("rewards", NUMBER), ("terminations", bool), ("truncations", bool)):
        check_per_agent(result[key], kind, agents, f"{what}'s {key}")
    check_per_agent(result["infos"], dict, agents, f"{what}'s infos")
    for key in ("rewards", "terminations", "truncations", "infos"):
        if missing := [a for a in acted if a not in result[key]]:
            raise Violation(f"{what}: {key} has nothing for {missing}, who acted in this step")


def check_acting(acting: Any, agents: list[str], what: str) -> None:
    if not all(isinstance(a, str) for a in acting) or len(set(acting)) != len(acting):
        raise Violation(f"{what}: acting should be distinct agent ids, got {acting!r}")
    if strangers := [a for a in acting if a not in agents]:
        raise Violation(f"{what}: acting names {strangers}, not agents of the episode {agents}")


def check_per_agent(values: dict[str, Any], kind: Any, agents: list[str], what: str) -> None:
    """``values`` maps agents of the episode to values of ``kind``."""
    if strangers := [a for a in values if a not in agents]:
        raise Violation(f"{what} name {strangers}, not agents of the episode {agents}")
    for agent, value in values.items():
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise Violation(f"{what}: {agent!r} should have {_kind_name(kind)}, got {value!r}")


def trajectory_step_v2(result: dict[str, Any]) -> tuple:
    """What must repeat when a v2 episode is replayed with the same seed and actions."""
    rewards = {agent: float(reward) for agent, reward in result["rewards"].items()}
    kept = ("observations", "terminations", "truncations", "infos", "acting")
    return (rewards, *(result[key] for key in kept))


# -- raw connections -----------------------------------------------------------------------------------------

# Requests that never finish within a check: a GET still in its headers, and a POST whose headers are complete
# and whose body (4096 bytes declared) is still coming.
SLOW_HEADERS = (b"", b"GET /health HTTP/1.1\r\nHost: conformance\r\nX-Slow: " + b"y" * 4096)
SLOW_BODY = (
    b"POST /v1/sessions HTTP/1.1\r\nHost: conformance\r\nContent-Type: application/json\r\n"
    b"Content-Length: 4096\r\n\r\n",
    b'{"env_id": "' + b"y" * 4084,
)


@contextlib.asynccontextmanager
async def slow_clients(url: str, n: int, interval: float) -> AsyncIterator[None]:
    """``n`` connections to the server at ``url``, each sending a request a byte every ``interval`` s (half still
    in their headers, half in their bodies) until the block ends or the server cuts them off; then closed."""
    host, port = _address(url)
    tasks = [asyncio.create_task(trickle(host, port, *(SLOW_HEADERS, SLOW_BODY)[i % 2], interval)) for i in range(n)]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def trickle(host: str, port: int, head: bytes, rest: bytes, interval: float) -> bytes | None:
    """Sends ``head``, then ``rest`` a byte every ``interval`` s until the server answers or closes the connection:
    what it sent (up to its close, or 5 s), b"" when it closed or reset the connection without a word, None when
    all was sent and it did neither."""
    reader, writer = await asyncio.open_connection(host, port)
    received = None
    try:
        writer.write(head)
        for i in range(len(rest)):
            writer.write(rest[i : i + 1])
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                received = await asyncio.wait_for(reader.read(65536), interval)
                break
        if received:
            async with asyncio.timeout(5):
                received += await reader.read()
    except OSError:  # reset by the server
        received = received or b""
    except TimeoutError:  # a reply that does not end
        pass
    finally:
        writer.close()
    return received


async def status_on_new_connection(url: str, path: str, within: float) -> int | None:
    """The status of ``GET path`` sent on a connection of its own (as a new client's), or None when its status
    line did not come within ``within`` s."""
    host, port = _address(url)
    try:
        async with asyncio.timeout(within):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
                line = await reader.readline()
            finally:
                writer.close()
    except (TimeoutError, OSError):
        return None
    parts = line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _kind_name(kind: Any) -> str:
    names = {str: "a string", bool: "a boolean", dict: "an object", list: "a list", int: "an integer"}
    return "a number" if kind == (int, float) else names.get(kind, str(kind))
