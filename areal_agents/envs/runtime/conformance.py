"""The env-step protocol's conformance suite: every rule of docs/env-protocol.md, checked against a live server.

    areal-agents check-env-server http://127.0.0.1:8765 --env-id cpp/GuessNumber-v0
    areal-agents check-env-server http://127.0.0.1:8765 --multi-agent-env areal_agents/Debate-v0

    report = check_env_server("http://127.0.0.1:8765", env_id="areal_agents/Arithmetic-v0")
    assert report.ok, report.failed

It plays episodes of one env with one fixed action, so that env's episodes must end within ``max_steps``
of that action. Limits come from ``/health``; the session cap is tested by filling it when it is at most
``session_probe_limit``, idle expiry by waiting when the timeout is at most 5 s. Run it against a server
nobody else uses: it counts open sessions. Not checked (they need a slow or failing env): ``session_busy``,
step timeouts, env failures; nor how long a server lets a slow request go on (only that it serves others).
A server whose /health lists v2 gets the v2 checks too (`conformance_v2`); a v1-only server passes on v1 alone.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from areal_agents.envs.runtime.conformance_probe import (
    NotSpoken,
    NotTestable,
    Probe,
    Violation,
    check_fields,
    check_step_result,
    expect_error,
    expect_ok,
    play,
    slow_clients,
    status_on_new_connection,
    trajectory_step,
)
from areal_agents.envs.runtime.conformance_v2 import V2_CHECKS, Check, choose_multi_agent_env
from areal_agents.envs.runtime.protocol import Limits
from areal_agents.errors import ArealAgentsError

PROTOCOLS = ("v1", "v2")
# /health's limits, as the protocol's schema has them (a float field also takes a JSON integer)
LIMIT_FIELDS = {
    name: (int, float) if f.annotation is float else f.annotation for name, f in Limits.model_fields.items()
}
LARGEST_BODY_SENT = 64 * 1024 * 1024  # a body limit above this is not probed (the suite would send that much)
CONCURRENT_SESSIONS = 32
IDLE_PROBE_LIMIT_S = 5  # idle expiry is checked when the server's timeout is this short
MAX_CONNECTIONS = 32  # a modest client's: within a thread-per-connection server's pool (sdk/cpp's)
SLOW_CLIENTS = 32  # connections sending a byte a second while /health is asked
HEALTH_WITHIN_S = 1.0
HEALTH_POLLS = 3  # one late answer is a loaded machine's; a stalled server misses them all


@dataclass
class CheckResult:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str = ""
    applies: bool = True  # False: a rule of a protocol version the server does not speak (a SKIP that is no mark)


@dataclass
class Report:
    results: list[CheckResult] = field(default_factory=list)
    env_id: str = ""
    multi_agent_env: str = ""
    protocols: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.results if r.status == "FAIL"]

    @property
    def skipped(self) -> list[str]:
        """The checks that could not run as the server is configured (a v1-only server's v2 checks are not here)."""
        return [r.name for r in self.results if r.status == "SKIP" and r.applies]

    @property
    def not_spoken(self) -> list[str]:
        """The checks of a protocol version the server does not speak."""
        return [r.name for r in self.results if not r.applies]

    @property
    def ok(self) -> bool:
        return not self.failed

    def lines(self) -> list[str]:
        return [f"{r.status} {r.name}" + (f": {r.detail}" if r.detail else "") for r in self.results]


# -- the checks: each raises Violation (FAIL) or NotTestable (SKIP) --------------------------------------------


async def check_health(p: Probe) -> None:
    """Status, protocol (v1, or v2 with ``protocols`` listing v1 and v2) and limits."""
    health = expect_ok(await p.request("GET", "/health"), "GET /health")
    check_fields(health, {"status": str, "protocol": str, "sessions_open": int, "limits": dict}, "/health")
    if health["status"] != "ok" or health["protocol"] not in PROTOCOLS:
        raise Violation(f"/health: expected status 'ok' and protocol 'v1' or 'v2', got {json.dumps(health)}")
    if health["protocol"] != "v1" or "protocols" in health:
        check_fields(health, {"protocols": list}, "/health of a server that speaks v2")
        if not {"v1", health["protocol"]} <= set(health["protocols"]):
            raise Violation(
                f"/health: protocols should list v1 and the protocol ({health['protocol']!r}): {json.dumps(health)}"
            )
    check_fields(health["limits"], LIMIT_FIELDS, "/health's limits")
    if any(health["limits"][k] <= 0 for k in LIMIT_FIELDS):
        raise Violation(f"/health's limits must be positive: {health['limits']}")


async def check_env_list(p: Probe) -> None:
    listed = expect_ok(await p.request("GET", "/v1/envs"), "GET /v1/envs")
    check_fields(listed, {"envs": list}, "/v1/envs")
    for env in listed["envs"]:
        check_fields(env, {"id": str, "description": str}, "an entry of /v1/envs")
    if p.env_id not in [env["id"] for env in listed["envs"]]:
        raise Violation(f"/v1/envs does not list the env under test, {p.env_id!r}")


async def check_session_lifecycle(p: Probe) -> None:
    """Create (sessions_open counts it), step (StepResult shape), close (closed: true), then it is gone."""
    before = await p.sessions_open()
    sid = (await p.create(seed=0))["session_id"]
    if await p.sessions_open() != before + 1:
        raise Violation("/health's sessions_open did not count a new session")
    await p.step_ok(sid)
    closed = expect_ok(await p.close(sid), f"DELETE /v1/sessions/{sid}")
    if closed != {"session_id": sid, "closed": True}:
        raise Violation(f"DELETE /v1/sessions/{sid}: expected {{'session_id': ..., 'closed': true}}, got {closed}")
    if await p.sessions_open() != before:
        raise Violation("/health's sessions_open still counts a closed session")
    expect_error(await p.step(sid), 404, "unknown_session", "a step on a closed session")
    expect_error(await p.close(sid), 404, "unknown_session", "closing a closed session")


async def check_optional_fields(p: Probe) -> None:
    """``kwargs``, ``seed`` and ``options`` may be absent or null (RemoteEnvPool sends null seed and options)."""
    bodies = [{"env_id": p.env_id, "kwargs": p.kwargs, "seed": None, "options": None}]
    bodies.append({"env_id": p.env_id, "kwargs": p.kwargs} if p.kwargs else {"env_id": p.env_id})
    for body in bodies:
        created = expect_ok(await p.request("POST", "/v1/sessions", body), f"POST /v1/sessions {json.dumps(body)}")
        check_fields(created, {"session_id": str, "observation": str, "info": dict}, "the created session")
        await p.close(created["session_id"])


async def check_idle_expiry(p: Probe) -> None:
    """A session with no step for idle_timeout_s is closed by the server (checked when that is short)."""
    idle = p.limits["idle_timeout_s"]
    if idle > IDLE_PROBE_LIMIT_S:
        raise NotTestable(f"idle_timeout_s is {idle}; start the server with an idle timeout of at most 5 s to check it")
    await p.close_leftovers()  # else one expiring first would look like this one's expiry
    sid = (await p.create(seed=0))["session_id"]
    before = await p.sessions_open()
    deadline = asyncio.get_running_loop().time() + 2 * idle + 3
    while await p.sessions_open() >= before:
        if asyncio.get_running_loop().time() > deadline:
            await p.close(sid)
            raise Violation(f"a session idle for {2 * idle + 3:.1f}s is still open (idle_timeout_s {idle})")
        await asyncio.sleep(0.1)
    expect_error(await p.step(sid), 404, "unknown_session", "a step on an expired session")


async def check_episode_end(p: Probe) -> None:
    """After terminated or truncated: a step is 409 episode_over and the session stays until it is closed."""
    sid, _ = await play(p, seed=1, keep=True)
    expect_error(await p.step(sid), 409, "episode_over", "a step after the episode ended")
    expect_ok(await p.close(sid), "closing a finished session")


async def check_same_seed_same_episode(p: Probe) -> None:
    _, first = await play(p, seed=2)
    _, second = await play(p, seed=2)
    if first != second:
        raise Violation(f"seed 2 gave two different episodes:\n  {first}\n  {second}")


async def check_batched_step(p: Probe) -> None:
    """/v1/step: results in order, as single steps give; a bad item fails alone; a repeated session fails all."""
    _, solo = await play(p, seed=3)
    a, b = (await p.create(seed=3))["session_id"], (await p.create(seed=3))["session_id"]
    unknown = uuid.uuid4().hex
    reply = await p.request(
        "POST", "/v1/step", {"steps": [{"session_id": s, "action": p.action} for s in (a, unknown, b)]}
    )
    results = expect_ok(reply, "POST /v1/step")["results"]
    if not isinstance(results, list) or len(results) != 3:
        raise Violation(f"POST /v1/step with 3 steps: expected 3 results, got {reply.describe()}")
    check_step_result(results[0], a, "batch result 0")
    check_step_result(results[2], b, "batch result 2")
    check_step_result(results[1], unknown, "the batch result of an unknown session", failed=True)
    if results[1]["error"]["type"] != "unknown_session":
        raise Violation(
            f"an unknown session in a batch: error type {results[1]['error']['type']!r}, not unknown_session"
        )
    if trajectory_step(results[0]) != solo[1] or trajectory_step(results[2]) != solo[1]:
        raise Violation(f"a batched step differs from the same step alone: {results[0]} vs {solo[1]}")
    twice = {"steps": [{"session_id": a, "action": p.action}, {"session_id": a, "action": p.action}]}
    expect_error(await p.request("POST", "/v1/step", twice), 400, "bad_request", "a session twice in one batch")
    empty = expect_ok(await p.request("POST", "/v1/step", {"steps": []}), "POST /v1/step with no steps")
    if empty != {"results": []}:
        raise Violation(f"POST /v1/step with no steps: expected {{'results': []}}, got {empty}")
    await expect_next_step(p, a, solo, 2, "after a refused batch")
    await asyncio.gather(p.close(a), p.close(b))


async def expect_next_step(p: Probe, sid: str, solo: list, k: int, when: str) -> None:
    """The session's next step is step ``k`` of its seed played alone (refused requests changed nothing)."""
    if k >= len(solo):  # that episode had ended by then
        expect_error(await p.step(sid), 409, "episode_over", f"a step {when}, once the episode ended")
        return
    result = await p.step_ok(sid)
    if trajectory_step(result) != solo[k]:
        raise Violation(f"a step {when} is not step {k} of the same seed played alone: {result} vs {solo[k]}")


async def check_unknown_ids(p: Probe) -> None:
    body = {"env_id": "no-such/Env-v0", "kwargs": {}}
    expect_error(await p.request("POST", "/v1/sessions", body), 404, "unknown_env", "an unknown env id")
    nobody = uuid.uuid4().hex
    expect_error(await p.step(nobody), 404, "unknown_session", "a step on a session that never existed")
    expect_error(await p.close(nobody), 404, "unknown_session", "closing a session that never existed")


def malformed_requests(p: Probe, sid: str) -> list[tuple[str, str, Any, str]]:
    """(what, path, body, the field its error must name): each is 400 bad_request. A bytes body is sent raw."""
    good = {"env_id": p.env_id, "kwargs": p.kwargs}
    step = f"/v1/sessions/{sid}/step"
    return [
        ("invalid JSON", "/v1/sessions", b'{"env_id": ', ""),
        ("a body that is not an object", "/v1/sessions", [good], ""),
        ("no env_id", "/v1/sessions", {"kwargs": {}}, "env_id"),
        ("env_id a number", "/v1/sessions", {**good, "env_id": 7}, "env_id"),
        ("kwargs not an object", "/v1/sessions", {**good, "kwargs": [1]}, "kwargs"),
        ("a negative seed", "/v1/sessions", {**good, "seed": -1}, "seed"),
        ("a seed that is not an integer", "/v1/sessions", {**good, "seed": "one"}, "seed"),
        ("an unknown field", "/v1/sessions", {**good, "sead": 1}, "sead"),
        ("no action", step, {}, "action"),
        ("action a number", step, {"action": 7}, "action"),
        ("an unknown field in a step", step, {"action": p.action, "extra": 1}, "extra"),
        ("invalid JSON in a step", step, b'{"action": "', ""),
        ("steps not a list", "/v1/step", {"steps": {"session_id": sid}}, "steps"),
        ("a batch item with no action", "/v1/step", {"steps": [{"session_id": sid}]}, "action"),
    ]


async def check_malformed_bodies(p: Probe) -> None:
    _, solo = await play(p, seed=4)
    sid = (await p.create(seed=4))["session_id"]
    before = await p.sessions_open()
    for what, path, body, names in malformed_requests(p, sid):
        raw = body if isinstance(body, bytes) else None
        reply = await p.request("POST", path, None if raw else body, raw=raw)
        expect_error(reply, 400, "bad_request", what, names)
    if await p.sessions_open() != before:
        raise Violation("a malformed request opened or closed a session")
    await expect_next_step(p, sid, solo, 1, "after malformed ones")  # the bad steps did not happen
    await p.close(sid)


async def check_action_limit(p: Probe) -> None:
    """Actions are measured in characters (code points): not bytes, not UTF-16 units."""
    limit, body_limit = p.limits["max_action_chars"], p.limits["max_body_bytes"]
    if 12 * limit + 100 > body_limit:  # an astral character is 12 bytes of JSON (two \\u escapes)
        raise NotTestable(f"max_action_chars {limit} does not fit in max_body_bytes {body_limit}")
    for char in ("7", "\u00e9", "\U0001d11e"):  # 1, 2 and 4 bytes in UTF-8; 𝄞 is 2 UTF-16 units
        sid = (await p.create(seed=0))["session_id"]
        what = f"an action of {limit + 1} x {char!r}"
        expect_error(await p.step(sid, char * (limit + 1)), 400, "action_too_long", what)
        await p.step_ok(sid, char * limit)  # at the limit is allowed (its episode may end; the step is normal)
        await p.close(sid)


async def check_body_limit(p: Probe) -> None:
    limit = p.limits["max_body_bytes"]
    if limit >= LARGEST_BODY_SENT:
        raise NotTestable(f"max_body_bytes {limit} is over the {LARGEST_BODY_SENT} bytes this suite sends")
    body = json.dumps({"env_id": p.env_id, "kwargs": {"padding": "x" * limit}}).encode()
    expect_error(await p.request("POST", "/v1/sessions", raw=body), 413, "payload_too_large", "a body over the limit")

    async def chunks():
        for start in range(0, len(body), 65536):
            yield body[start : start + 65536]

    reply = await p.request_chunked("/v1/sessions", chunks())
    expect_error(reply, 413, "payload_too_large", "a chunked body over the limit")


async def check_session_cap(p: Probe) -> None:
    """Creations racing for the last places: exactly as many succeed as there are places, the rest are 429."""
    cap, open_now = p.limits["max_sessions"], await p.sessions_open()
    if cap > p.session_probe_limit:
        raise NotTestable(f"max_sessions is {cap}; pass --session-probe-limit {cap} to fill it")
    places = cap - open_now
    if places < 1:
        raise NotTestable(f"the cap of {cap} sessions is full already; run the suite on a server nobody else uses")
    replies = await asyncio.gather(*(p.request("POST", "/v1/sessions", _create_body(p, i)) for i in range(places + 4)))
    opened = [r.body["session_id"] for r in replies if r.status == 200]
    try:
        refused = [r for r in replies if r.status != 200]
        if len(opened) != places:
            raise Violation(
                f"{places + 4} concurrent creations with {places} places left opened {len(opened)} sessions"
            )
        for reply in refused:
            expect_error(reply, 429, "too_many_sessions", "a creation over max_sessions")
        await p.close(opened.pop())
        opened.append((await p.create(seed=0))["session_id"])  # a closed session's place is free again
    finally:
        await asyncio.gather(*(p.close(sid) for sid in opened))


async def check_concurrent_sessions(p: Probe) -> None:
    """Many episodes at once, by single and batched steps, each the same as its seed played alone."""
    n = min(CONCURRENT_SESSIONS, p.limits["max_sessions"] - await p.sessions_open())
    if n < 2:
        raise NotTestable(f"{n} free session places; run the suite on a server nobody else uses")
    alone = [(await play(p, seed))[1] for seed in range(100, 100 + n)]

    async def batched(sid: str) -> dict:
        reply = await p.request("POST", "/v1/step", {"steps": [{"session_id": sid, "action": p.action}]})
        return expect_ok(reply, "POST /v1/step")["results"][0]

    played = await asyncio.gather(*(play(p, seed, batched if seed % 2 else None) for seed in range(100, 100 + n)))
    if len({sid for sid, _ in played}) != n:
        raise Violation(f"{n} concurrent sessions got {len({sid for sid, _ in played})} distinct session ids")
    for seed, (_, together), solo in zip(range(100, 100 + n), played, alone):
        if together != solo:
            raise Violation(f"seed {seed} played among {n} concurrent sessions differs from it played alone")


async def check_unknown_path(p: Probe) -> None:
    reply = await p.request("GET", "/v1/no-such-route")
    if reply.status != 404:
        raise Violation(f"an unknown path: expected 404, got {reply.describe()}")


async def check_slow_clients(p: Probe) -> None:
    """32 connections sending their requests a byte a second (half in their headers, half in their bodies) leave
    /health answering a new connection within a second: slow clients must not hold what other clients need."""
    late = []
    async with slow_clients(p.url, SLOW_CLIENTS, interval=1.0):
        await asyncio.sleep(0.3)  # each has sent its first byte: the server is reading them all
        for _ in range(HEALTH_POLLS):
            started = asyncio.get_running_loop().time()
            status = await status_on_new_connection(p.url, "/health", HEALTH_WITHIN_S)
            if status != 200:
                late.append("no answer" if status is None else f"HTTP {status}")
            await asyncio.sleep(max(0.0, started + 0.2 - asyncio.get_running_loop().time()))
    if len(late) > 1:
        raise Violation(
            f"while {SLOW_CLIENTS} connections sent requests a byte a second, GET /health on a new connection got "
            f"no 200 within {HEALTH_WITHIN_S:.0f} s {len(late)} times of {HEALTH_POLLS} ({', '.join(late)}); "
            "a server must time out slow headers and bodies, and serve other requests meanwhile"
        )
    expect_ok(await p.request("GET", "/health"), "GET /health once the slow clients left")


async def check_json_replies(p: Probe) -> None:
    """Every reply the suite received said Content-Type: application/json (run last)."""
    if p.not_json:
        raise Violation("; ".join(p.not_json))


def _create_body(p: Probe, seed: int) -> dict[str, Any]:
    return {"env_id": p.env_id, "kwargs": p.kwargs, "seed": seed}


CHECKS: list[tuple[str, Check]] = [
    ("health reports the protocol and limits", check_health),
    ("/v1/envs lists the env", check_env_list),
    ("session lifecycle", check_session_lifecycle),
    ("kwargs, seed and options may be absent or null", check_optional_fields),
    ("episode end (409 episode_over)", check_episode_end),
    ("same seed, same episode", check_same_seed_same_episode),
    ("batched step", check_batched_step),
    ("unknown env and session (404)", check_unknown_ids),
    ("malformed bodies (400)", check_malformed_bodies),
    ("action limit (400 action_too_long)", check_action_limit),
    ("body limit (413)", check_body_limit),
    ("session cap (429)", check_session_cap),
    ("concurrent sessions", check_concurrent_sessions),
    ("unknown path (404)", check_unknown_path),
    ("slow clients do not stall the server", check_slow_clients),
    ("idle sessions expire", check_idle_expiry),
    *V2_CHECKS,
    ("JSON replies", check_json_replies),
]


async def run_checks(probe: Probe, checks: list[tuple[str, Check]] = CHECKS) -> Report:
    """Every check in order; one that breaks a rule is reported and the next one runs."""
    report = Report()
    for name, check in checks:
        try:
            await check(probe)
            report.results.append(CheckResult(name, "PASS"))
        except NotSpoken as e:
            report.results.append(CheckResult(name, "SKIP", str(e), applies=False))
        except NotTestable as e:
            report.results.append(CheckResult(name, "SKIP", str(e)))
        except Violation as e:
            report.results.append(CheckResult(name, "FAIL", str(e)))
        except Exception as e:  # a reply of an unexpected shape, a dropped connection: that check fails, not the run
            report.results.append(CheckResult(name, "FAIL", f"{type(e).__name__}: {e}"))
    return report


async def acheck_env_server(
    url: str, *, env_id: str = "", timeout: float = 60.0, checks: list[tuple[str, Check]] = CHECKS, **options: Any
) -> Report:
    """`check_env_server`, in a running event loop; ``checks``: the suite's, or some of them in its order."""
    probe = Probe(url.rstrip("/"), env_id=env_id, **options)
    connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as client:
        probe.client = client
        health = await probe.request("GET", "/health")
        if isinstance(health.body, dict) and isinstance(health.body.get("limits"), dict):
            probe.limits = health.body["limits"]
        if isinstance(health.body, dict) and isinstance(health.body.get("protocols"), list):
            probe.protocols = [str(version) for version in health.body["protocols"]]
        if not probe.env_id:
            probe.env_id = await _first_env(probe)
        await choose_multi_agent_env(probe)
        if not all(isinstance(probe.limits.get(k), int | float) for k in LIMIT_FIELDS):
            report = Report([CheckResult(CHECKS[0][0], "FAIL", f"GET /health gave no limits: {health.describe()}")])
            report.results += [CheckResult(name, "SKIP", "the server's limits are unknown") for name, _ in CHECKS[1:]]
        else:
            report = await run_checks(probe, checks)
        report.env_id, report.multi_agent_env, report.protocols = probe.env_id, probe.multi_agent_env, probe.protocols
        return report


def check_env_server(url: str, *, env_id: str = "", **options: Any) -> Report:
    """Check the env-step server at ``url`` against the protocol, playing ``env_id`` (default: the first listed)
    and, on a v2 server, ``multi_agent_env`` (default: areal_agents/Debate-v0 when listed)."""
    return asyncio.run(acheck_env_server(url, env_id=env_id, **options))


def run_cli(
    url: str, env_id: str, kwargs: str, *, strict: bool = False, multi_agent_kwargs: str = "{}", **options: Any
) -> int:
    """``areal-agents check-env-server``: a line per check; exit 1 when one failed (or, ``strict``, was skipped).
    A v1-only server's v2 checks are shown as SKIP but are no failure, under ``strict`` too: it conforms to v1."""
    options["multi_agent_kwargs"] = _json_object(multi_agent_kwargs, "--multi-agent-kwargs")
    try:
        report = check_env_server(url, env_id=env_id, kwargs=_json_object(kwargs, "--kwargs"), **options)
    except (aiohttp.ClientError, TimeoutError, Violation) as e:
        raise ArealAgentsError(f"cannot check {url}: {type(e).__name__}: {e}") from None
    passed = sum(r.status == "PASS" for r in report.results)
    envs = f"env {report.env_id}" + (f", multi-agent env {report.multi_agent_env}" if report.multi_agent_env else "")
    summary = f"{passed} passed, {len(report.failed)} failed, {len(report.skipped)} skipped ({url}, {envs})"
    if report.not_spoken:
        summary += f"; the server speaks v1 only, so its {len(report.not_spoken)} v2 checks were not run"
    print("\n".join([*report.lines(), summary]))
    return 0 if report.ok and not (strict and report.skipped) else 1


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        parsed = json.loads(text)
    except ValueError as e:
        raise ArealAgentsError(f"{flag} is not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ArealAgentsError(f"{flag} should be a JSON object, got {text!r}")
    return parsed


async def _first_env(p: Probe) -> str:
    envs = (await p.request("GET", "/v1/envs")).body
    try:
        return envs["envs"][0]["id"]
    except (TypeError, KeyError, IndexError):
        raise Violation(f"GET /v1/envs lists no env to play; pass --env-id: {envs!r}") from None


__all__ = ["CHECKS", "CheckResult", "Report", "acheck_env_server", "check_env_server", "run_cli"]
