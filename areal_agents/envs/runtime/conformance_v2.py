"""The conformance suite's v2 checks: sessions of several agents (docs/env-protocol.md, "v2").

They run when /health lists v2 (else each is a SKIP that is no mark: the server conforms to v1). Those that
need a multi-agent env play ``--multi-agent-env`` (default: areal_agents/Debate-v0 when /v1/envs lists it; with
none to play they are SKIP); every acting agent sends ``--action``, so its episodes must end within
``--max-steps``. The others play the single-agent env under test, served over v2 as the one agent "agent".
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from areal_agents.envs.runtime.conformance_probe import (
    NotSpoken,
    NotTestable,
    Probe,
    Violation,
    check_step_result_v2,
    expect_error,
    expect_ok,
    play,
    trajectory_step,
    trajectory_step_v2,
)

DEFAULT_MULTI_AGENT_ENV = "areal_agents/Debate-v0"
# owners a server must refuse (1..128 characters of [A-Za-z0-9_.:-]): empty, too long, a space, a slash, non-ASCII
BAD_OWNERS = ["", "r" * 129, "my run", "runs/1", "r\u00e9sum\u00e9", 7]
Check = Callable[[Probe], Awaitable[None]]
Step = Callable[[Probe, str, list[str], list[str]], Awaitable[dict]]


async def choose_multi_agent_env(p: Probe) -> None:
    """The multi-agent env the v2 checks play, when none was named: Debate-v0 if the server lists it."""
    if p.multi_agent_env or "v2" not in p.protocols:
        return
    listed = (await p.request("GET", "/v1/envs")).body
    envs = listed.get("envs") if isinstance(listed, dict) else None
    if isinstance(envs, list) and any(isinstance(e, dict) and e.get("id") == DEFAULT_MULTI_AGENT_ENV for e in envs):
        p.multi_agent_env = DEFAULT_MULTI_AGENT_ENV


def speaks_v2(check: Check) -> Check:
    """``check``, run only against a server whose /health lists v2."""

    @functools.wraps(check)
    async def run(p: Probe) -> None:
        if "v2" not in p.protocols:
            raise NotSpoken(f"the server speaks v1 only (/health protocols {p.protocols}): not a v2 rule for it")
        await check(p)

    return run


def multi_agent(check: Check) -> Check:
    """``check``, run only with a multi-agent env to play (and a v2 server)."""

    @functools.wraps(check)
    async def run(p: Probe) -> None:
        if not p.multi_agent_env:
            raise NotTestable(
                f"no multi-agent env to play (/v1/envs does not list {DEFAULT_MULTI_AGENT_ENV}); "
                "pass --multi-agent-env ID (and --multi-agent-kwargs JSON)"
            )
        await check(p)

    return speaks_v2(run)


# -- playing over v2 -----------------------------------------------------------------------------------------


async def single_step(p: Probe, sid: str, acting: list[str], agents: list[str]) -> dict[str, Any]:
    """Every acting agent's action, in one ``POST /v2/sessions/{id}/step``; its checked reply."""
    result = expect_ok(await p.step_v2(sid, p.actions(acting)), f"POST /v2/sessions/{sid}/step")
    check_step_result_v2(result, sid, acting, agents, "the v2 step's reply")
    return result


async def batched_step(p: Probe, sid: str, acting: list[str], agents: list[str]) -> dict[str, Any]:
    """The same step as a batch of one, ``POST /v2/step``."""
    reply = await p.request("POST", "/v2/step", {"steps": [{"session_id": sid, "actions": p.actions(acting)}]})
    results = expect_ok(reply, "POST /v2/step")["results"]
    if not isinstance(results, list) or len(results) != 1:
        raise Violation(f"POST /v2/step with 1 step: expected 1 result, got {reply.describe()}")
    check_step_result_v2(results[0], sid, acting, agents, "the v2 batch's result")
    return results[0]


async def play_v2(p: Probe, seed: int, step: Step = single_step, *, keep: bool = False) -> tuple[str, list]:
    """One episode of the multi-agent env to its end (``acting`` empty): (its session id, its reset, then each
    step). The session is closed after it unless ``keep``."""
    created = await p.create_v2(seed=seed)
    sid, agents, acting = created["session_id"], created["agents"], created["acting"]
    trajectory: list = [(created["observations"], created["infos"], acting, created["multi_agent"])]
    for _ in range(p.max_steps):
        result = await step(p, sid, acting, agents)
        trajectory.append(trajectory_step_v2(result))
        acting = result["acting"]
        if not acting:
            if not keep:
                expect_ok(await p.close(sid, "v2"), "closing a finished v2 session")
            return sid, trajectory
    await p.close(sid, "v2")
    raise NotTestable(
        f"an episode of {p.multi_agent_env} did not end within {p.max_steps} steps of action {p.action!r} from "
        "each acting agent; pass --action or --max-steps"
    )


async def expect_next_step_v2(p: Probe, created: dict[str, Any], solo: list, k: int, when: str) -> None:
    """The session's next step is step ``k`` of its seed played alone (refused requests changed nothing)."""
    sid, agents = created["session_id"], created["agents"]
    acting = solo[k - 1][-1] if k > 1 else created["acting"]  # who acts after step k - 1
    if k >= len(solo):
        expect_error(await p.step_v2(sid, p.actions(acting)), 409, "episode_over", f"a v2 step {when}")
        return
    result = await single_step(p, sid, acting, agents)
    if trajectory_step_v2(result) != solo[k]:
        raise Violation(f"a v2 step {when} is not step {k} of the same seed played alone: {result} vs {solo[k]}")


# -- the checks ----------------------------------------------------------------------------------------------


@multi_agent
async def check_create_and_close(p: Probe) -> None:
    """A multi-agent session: its create reply (checked in `create_v2`), counted open, closed by DELETE."""
    before = await p.sessions_open()
    created = await p.create_v2(seed=0)
    sid = created["session_id"]
    if created["multi_agent"] is not True:
        raise Violation(f"POST /v2/sessions of {p.multi_agent_env}: multi_agent should be true, got {created}")
    if await p.sessions_open() != before + 1:
        raise Violation("/health's sessions_open did not count a new v2 session")
    closed = expect_ok(await p.close(sid, "v2"), f"DELETE /v2/sessions/{sid}")
    if closed != {"session_id": sid, "closed": True}:
        raise Violation(f"DELETE /v2/sessions/{sid}: expected {{'session_id': ..., 'closed': true}}, got {closed}")
    if await p.sessions_open() != before:
        raise Violation("/health's sessions_open still counts a closed v2 session")
    expect_error(await p.step_v2(sid, p.actions(created["acting"])), 404, "unknown_session", "a step on a closed one")
    expect_error(await p.close(sid, "v2"), 404, "unknown_session", "closing a closed v2 session")
    other = (await p.create_v2(seed=0))["session_id"]  # either path closes any session
    expect_ok(await p.close(other, "v1"), "DELETE /v1/sessions/{id} of a v2 session")


@multi_agent
async def check_episode_end(p: Probe) -> None:
    """Played to ``acting`` [], by single steps then by batches of one (the same episode); then 409 episode_over."""
    sid, alone = await play_v2(p, seed=1, keep=True)
    acting = alone[-2][-1] if len(alone) > 2 else alone[0][2]
    expect_error(await p.step_v2(sid, p.actions(acting)), 409, "episode_over", "a v2 step after the episode ended")
    expect_ok(await p.close(sid, "v2"), "closing a finished v2 session")
    _, batched = await play_v2(p, seed=1, step=batched_step)
    if batched != alone:
        raise Violation(
            f"seed 1 played by POST /v2/step differs from it played by single steps:\n  {batched}\n  {alone}"
        )


@multi_agent
async def check_same_seed_same_episode(p: Probe) -> None:
    _, first = await play_v2(p, seed=2)
    _, second = await play_v2(p, seed=2)
    if first != second:
        raise Violation(f"seed 2 gave two different v2 episodes:\n  {first}\n  {second}")


def bad_steps(p: Probe, created: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(what, body, what its error must name): each is 400 bad_request. A bytes body is sent raw."""
    acting, agents = created["acting"], created["agents"]
    actions = p.actions(acting)
    cases = [
        (
            f"actions without {acting[0]!r}",
            {"actions": {a: x for a, x in actions.items() if a != acting[0]}},
            acting[0],
        ),
        ("an action of an agent not in the episode", {"actions": {**actions, "nobody_7": p.action}}, "nobody_7"),
        ("no actions", {}, "actions"),
        ("actions not an object", {"actions": [p.action]}, "actions"),
        ("an action that is a number", {"actions": {**actions, acting[0]: 7}}, acting[0]),
        ("an unknown field in a v2 step", {"actions": actions, "extra": 1}, "extra"),
        ("invalid JSON in a v2 step", b'{"actions": {"', ""),
    ]
    if waiting := [a for a in agents if a not in acting]:  # a turn-based env: an agent whose turn it is not
        cases.append(
            (f"an action of {waiting[0]!r}, who is not acting", {"actions": {**actions, waiting[0]: "0"}}, waiting[0])
        )
    return cases


@multi_agent
async def check_actions_of_acting_agents(p: Probe) -> None:
    """A step must act for exactly the acting agents: anything else is 400 bad_request naming the ids at fault,
    and changes nothing (the next good step is the one the seed plays alone)."""
    _, solo = await play_v2(p, seed=4)
    created = await p.create_v2(seed=4)
    sid = created["session_id"]
    before = await p.sessions_open()
    for what, body, names in bad_steps(p, created):
        raw = body if isinstance(body, bytes) else None
        reply = await p.request("POST", f"/v2/sessions/{sid}/step", None if raw else body, raw=raw)
        expect_error(reply, 400, "bad_request", what, names)
    if await p.sessions_open() != before:
        raise Violation("a refused v2 step opened or closed a session")
    await expect_next_step_v2(p, created, solo, 1, "after refused ones")
    await p.close(sid, "v2")


@multi_agent
async def check_action_limit(p: Probe) -> None:
    """One agent's action over max_action_chars (characters, not bytes) is 400 action_too_long naming it."""
    limit, body_limit = p.limits["max_action_chars"], p.limits["max_body_bytes"]
    if 12 * limit + 4096 > body_limit:  # an astral character is 12 bytes of JSON (two \\u escapes)
        raise NotTestable(f"max_action_chars {limit} does not fit in max_body_bytes {body_limit}")
    for char in ("7", "\U0001d11e"):
        created = await p.create_v2(seed=0)
        sid, acting = created["session_id"], created["acting"]
        what = f"a v2 action of {limit + 1} x {char!r} from {acting[-1]!r}"
        reply = await p.step_v2(sid, {**p.actions(acting), acting[-1]: char * (limit + 1)})
        expect_error(reply, 400, "action_too_long", what, acting[-1])
        result = expect_ok(
            await p.step_v2(sid, {**p.actions(acting), acting[-1]: char * limit}), "an action at the limit"
        )
        check_step_result_v2(result, sid, acting, created["agents"], "the reply to an action at the limit")
        await p.close(sid, "v2")


@multi_agent
async def check_batched_step(p: Probe) -> None:
    """/v2/step: results in order, as single steps give; bad items fail alone; a repeated session fails all."""
    _, solo = await play_v2(p, seed=3)
    a, b, c = [await p.create_v2(seed=3) for _ in range(3)]
    acting, agents, unknown = a["acting"], a["agents"], uuid.uuid4().hex
    missing = {x: y for x, y in p.actions(acting).items() if x != acting[0]}
    items = [(a["session_id"], p.actions(acting)), (unknown, p.actions(acting)), (b["session_id"], missing)]
    items.append((c["session_id"], p.actions(acting)))
    reply = await p.request("POST", "/v2/step", {"steps": [{"session_id": s, "actions": x} for s, x in items]})
    results = expect_ok(reply, "POST /v2/step")["results"]
    if not isinstance(results, list) or len(results) != len(items):
        raise Violation(f"POST /v2/step with {len(items)} steps: expected as many results, got {reply.describe()}")
    for i, ((sid, _), error) in enumerate(zip(items, [None, "unknown_session", "bad_request", None])):
        check_step_result_v2(results[i], sid, acting, agents, f"v2 batch result {i}", failed=error is not None)
        if error and results[i]["error"]["type"] != error:
            raise Violation(f"v2 batch result {i}: error type {results[i]['error']['type']!r}, expected {error!r}")
        if not error and trajectory_step_v2(results[i]) != solo[1]:
            raise Violation(f"a v2 batched step differs from the same step alone: {results[i]} vs {solo[1]}")
    twice = {"steps": [{"session_id": a["session_id"], "actions": p.actions(solo[1][-1])}] * 2}
    expect_error(await p.request("POST", "/v2/step", twice), 400, "bad_request", "a session twice in one v2 batch")
    empty = expect_ok(await p.request("POST", "/v2/step", {"steps": []}), "POST /v2/step with no steps")
    if empty != {"results": []}:
        raise Violation(f"POST /v2/step with no steps: expected {{'results': []}}, got {empty}")
    await expect_next_step_v2(p, a, solo, 2, "after a refused v2 batch")
    for created in (a, b, c):
        await p.close(created["session_id"], "v2")


@multi_agent
async def check_v1_refuses_multi_agent_env(p: Probe) -> None:
    before = await p.sessions_open()
    body = {"env_id": p.multi_agent_env, "kwargs": p.multi_agent_kwargs, "seed": 0}
    reply = await p.request("POST", "/v1/sessions", body)
    expect_error(reply, 400, "bad_request", "POST /v1/sessions of a multi-agent env", p.multi_agent_env)
    if await p.sessions_open() != before:
        raise Violation("a refused v1 creation of a multi-agent env opened a session")


@speaks_v2
async def check_single_agent_env(p: Probe) -> None:
    """The single-agent env under test over v2 is the one agent "agent" (multi_agent false), playing the episode
    v1 plays; its session also steps over v1; either protocol's DELETE closes the other's sessions."""
    _, v1 = await play(p, seed=5)
    created = await p.create_v2(seed=5, env_id=p.env_id, kwargs=p.kwargs)
    sid = created["session_id"]
    first = (created["multi_agent"], created["agents"], created["acting"], created["observations"], created["infos"])
    if first != (False, ["agent"], ["agent"], {"agent": v1[0][0]}, {"agent": v1[0][1]}):
        raise Violation(f"{p.env_id} over v2 should be the one agent 'agent' with v1's reset: {created} vs {v1[0]}")
    for k in range(1, len(v1)):
        result = await single_step(p, sid, ["agent"], ["agent"])
        got = [result[key].get("agent", default) for key, default in STEP_AS_V1]
        if tuple(got) != v1[k] or result["acting"] != ([] if k == len(v1) - 1 else ["agent"]):
            raise Violation(f"step {k} of {p.env_id} over v2 differs from it over v1: {result} vs {v1[k]}")
    expect_error(await p.step_v2(sid, {"agent": p.action}), 409, "episode_over", "a v2 step after the episode ended")
    expect_ok(await p.close(sid, "v2"), "DELETE /v2/sessions/{id} of a single-agent session")
    sid = (await p.create_v2(seed=5, env_id=p.env_id, kwargs=p.kwargs))["session_id"]
    result = await p.step_ok(sid)
    if trajectory_step(result) != v1[1]:
        raise Violation(f"a v2 session stepped over v1 differs from a v1 one: {result} vs {v1[1]}")
    expect_ok(await p.close(sid, "v1"), "DELETE /v1/sessions/{id} of a v2 session")
    sid = (await p.create(seed=5))["session_id"]
    expect_ok(await p.close(sid, "v2"), "DELETE /v2/sessions/{id} of a v1 session")


STEP_AS_V1 = [("observations", ""), ("rewards", 0.0), ("terminations", False), ("truncations", False), ("infos", {})]


@speaks_v2
async def check_unknown_ids(p: Probe) -> None:
    body = {"env_id": "no-such/Env-v0", "kwargs": {}}
    expect_error(await p.request("POST", "/v2/sessions", body), 404, "unknown_env", "an unknown env id over v2")
    nobody = uuid.uuid4().hex
    reply = await p.step_v2(nobody, {"agent": p.action})
    expect_error(reply, 404, "unknown_session", "a v2 step on a session that never existed")
    expect_error(await p.close(nobody, "v2"), 404, "unknown_session", "closing a session that never existed (v2)")


@speaks_v2
async def check_owner(p: Probe) -> None:
    """``owner`` tags sessions (v2 and v1 creations); DELETE /v2/sessions?owner= closes exactly the owner's."""
    before = await p.sessions_open()
    for bad in BAD_OWNERS:
        for version in ("v1", "v2"):
            body = {"env_id": p.env_id, "kwargs": p.kwargs, "owner": bad}
            reply = await p.request("POST", f"/{version}/sessions", body)
            expect_error(reply, 400, "bad_request", f"POST /{version}/sessions with owner {bad!r}", "owner")
    if await p.sessions_open() != before:
        raise Violation("a creation refused for its owner opened a session")
    for query in ("", "?owner=", "?owner=my%20run"):
        reply = await p.request("DELETE", f"/v2/sessions{query}")
        expect_error(reply, 400, "bad_request", f"DELETE /v2/sessions{query}", "owner")
    owner, other = f"conformance-{uuid.uuid4().hex[:12]}", f"conformance.other:{uuid.uuid4().hex[:12]}"
    mine = [(await p.create_v2(seed=i, env_id=p.env_id, kwargs=p.kwargs, owner=owner))["session_id"] for i in (0, 1)]
    mine.append((await p.create(seed=2, owner=owner))["session_id"])
    theirs = [(await p.create_v2(seed=3, env_id=p.env_id, kwargs=p.kwargs, owner=other))["session_id"]]
    theirs.append((await p.create(seed=4))["session_id"])
    try:
        closed = expect_ok(await p.close_owned(owner), f"DELETE /v2/sessions?owner={owner}")
        if closed != {"owner": owner, "closed": len(mine)}:
            raise Violation(f"DELETE /v2/sessions?owner=: expected {{'owner': {owner!r}, 'closed': 3}}, got {closed}")
        if await p.sessions_open() != before + len(theirs):
            raise Violation(f"after closing {owner!r}'s 3 sessions, /health's sessions_open is not {before + 2}")
        for sid in mine:
            expect_error(await p.step(sid), 404, "unknown_session", "a step on a session closed by owner")
        for sid in theirs:
            await p.step_ok(sid)  # another owner's session, and one without an owner, are still open
        again = expect_ok(await p.close_owned(owner), "DELETE /v2/sessions?owner= once more")
        if again != {"owner": owner, "closed": 0}:
            raise Violation(f"DELETE /v2/sessions?owner= with nothing left: expected closed 0, got {again}")
    finally:
        for sid in theirs:
            await p.close(sid)


V2_CHECKS: list[tuple[str, Check]] = [
    ("v2: unknown env and session (404)", check_unknown_ids),
    ("v2: a single-agent env is the one agent 'agent'", check_single_agent_env),
    ("v2: owner tags, close by owner", check_owner),
    ("v2: create and close a multi-agent session", check_create_and_close),
    ("v2: v1 refuses a multi-agent env (400)", check_v1_refuses_multi_agent_env),
    ("v2: episode end, single and batched steps (409 episode_over)", check_episode_end),
    ("v2: same seed, same episode", check_same_seed_same_episode),
    ("v2: actions of exactly the acting agents (400)", check_actions_of_acting_agents),
    ("v2: action limit (400 action_too_long)", check_action_limit),
    ("v2: batched step", check_batched_step),
]

__all__ = ["DEFAULT_MULTI_AGENT_ENV", "V2_CHECKS", "choose_multi_agent_env"]
