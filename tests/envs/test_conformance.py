"""The conformance suite (`check-env-server`): it passes against our Python server (v1 and v2), each rule broken on
purpose in a copy of that server is caught by the check for that rule, and by that check alone, and a server that
speaks v1 only passes on v1 (its v2 checks are not run)."""

import asyncio
import contextlib
import random

import pytest
from app_in_thread import serving_app

from areal_agents.cli import main
from areal_agents.envs.registry import describe_envs
from areal_agents.envs.runtime import server as server_module
from areal_agents.envs.runtime import server_v2, sessions
from areal_agents.envs.runtime.conformance import CHECKS, check_env_server
from areal_agents.envs.runtime.conformance_v2 import V2_CHECKS
from areal_agents.envs.runtime.protocol import MultiBatchStepResult, OwnerClosed, SessionCreated, reply
from areal_agents.envs.runtime.remote import EnvServerProcess
from areal_agents.envs.runtime.server import EnvServer, HTTPError, ServerConfig, build_app
from areal_agents.net import free_port

ARITHMETIC, DEBATE, TURNS = "areal_agents/Arithmetic-v0", "areal_agents/Debate-v0", "areal_agents_testing/Turns-v0"
V2_NAMES = [name for name, _ in V2_CHECKS]
V2_SINGLE, V2_OWNER, V2_V1_REFUSES = (
    "v2: a single-agent env is the one agent 'agent'",
    "v2: owner tags, close by owner",
    "v2: v1 refuses a multi-agent env (400)",
)
V2_END, V2_SEED, V2_KEYS = (
    "v2: episode end, single and batched steps (409 episode_over)",
    "v2: same seed, same episode",
    "v2: actions of exactly the acting agents (400)",
)
V2_ACTION_LIMIT, V2_BATCH = "v2: action limit (400 action_too_long)", "v2: batched step"
LIMITS = {"max_sessions": 16, "max_body_bytes": 65536, "max_action_chars": 1000, "idle_timeout": 5}


@contextlib.contextmanager
def serving(server_class: type[EnvServer], wrap=lambda app: app):
    """``server_class`` behind the real app (wrapped by ``wrap``), on a free port in this process; its URL."""
    port = free_port()
    with serving_app(wrap(build_app(server_class(ServerConfig(port=port, workers=4, **LIMITS)))), port) as url:
        yield url


@pytest.mark.process
def test_the_python_server_passes_every_check():
    with EnvServerProcess(**LIMITS) as server:
        report = check_env_server(server.url, env_id=ARITHMETIC)
    assert report.ok and not report.skipped, report.lines()
    assert [r.name for r in report.results] == [name for name, _ in CHECKS]


@pytest.mark.process
def test_the_cli_prints_a_line_per_check_and_exits_1_on_a_failure(capsys):
    with EnvServerProcess(**LIMITS) as server:
        assert main(["check-env-server", server.url, "--env-id", ARITHMETIC, "--kwargs", '{"max_turns": 2}']) == 0
        out = capsys.readouterr().out
        assert out.count("PASS ") == len(CHECKS) and "0 failed, 0 skipped" in out
        # episodes that do not end: what needs one is skipped, with what to pass
        argv = [
            "check-env-server",
            server.url,
            "--env-id",
            ARITHMETIC,
            "--max-steps",
            "1",
            "--kwargs",
            '{"max_turns": 3}',
        ]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "SKIP episode end (409 episode_over): an episode did not end within 1 steps of action '0'" in out
        assert "0 failed, 10 skipped" in out  # 5 of v1, 5 of v2 (debates of 2 rounds)
        assert main([*argv, "--strict"]) == 1  # strict: what could not be checked fails
    with serving(NoEpisodeEnd) as url:
        assert main(["check-env-server", url, "--env-id", ARITHMETIC]) == 1
    out = capsys.readouterr().out
    assert "FAIL episode end (409 episode_over): a step after the episode ended: expected 409" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["http://127.0.0.1:1"], "cannot check http://127.0.0.1:1: ClientConnectorError"),
        (["http://127.0.0.1:1", "--kwargs", "{digits: 2}"], "--kwargs is not JSON"),
        (["http://127.0.0.1:1", "--kwargs", "[2]"], "--kwargs should be a JSON object"),
        (["http://127.0.0.1:1", "--multi-agent-kwargs", "{rounds: 1}"], "--multi-agent-kwargs is not JSON"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys):
    assert main(["check-env-server", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


# -- the Python server with one rule broken ---------------------------------------------------------------------


class NoEpisodeEnd(EnvServer):
    """Steps on after the episode ended (no 409 episode_over)."""

    async def step(self, sid, action):
        self._get(sid).done = False
        return await super().step(sid, action)


class NoLimitsInHealth(EnvServer):
    def health(self):
        return {"status": "ok", "protocol": "v1", "sessions_open": len(self.sessions)}


class SeedIgnored(EnvServer):
    """Resets with a seed of its own choosing."""

    async def create(self, req):
        return await super().create(req.model_copy(update={"seed": random.randrange(10**6)}))


class RacyCap(EnvServer):
    """Checks the session cap, then awaits before taking the place: concurrent creations overshoot it."""

    async def create(self, req):
        if len(self.sessions) >= self.cfg.max_sessions:
            raise HTTPError(429, "too_many_sessions", "full")
        await asyncio.sleep(0.05)
        self.cfg.max_sessions += 1_000_000  # let the parent's own check pass
        try:
            return await super().create(req)
        finally:
            self.cfg.max_sessions -= 1_000_000


class BatchOutOfOrder(EnvServer):
    async def step_batch(self, req):
        reply = await super().step_batch(req)
        return {"results": reply.results[::-1]}


class CloseKeepsTheSession(EnvServer):
    """DELETE answers closed: true but the session lives on."""

    async def close(self, sid):
        self._get(sid)
        return {"session_id": sid, "closed": True}


class SeedRequired(EnvServer):
    async def create(self, req):
        if req.seed is None:
            raise HTTPError(400, "bad_request", "body.seed: required")
        return await super().create(req)


class ActionBytesCounted(EnvServer):
    """Measures actions in UTF-8 bytes rather than characters."""

    async def step(self, sid, action):
        if len(action.encode()) > self.cfg.max_action_chars:
            raise HTTPError(400, "action_too_long", "too long")
        return await super().step(sid, action)


class NoIdleExpiry(EnvServer):
    async def expire_idle(self):
        return 0


class BatchStepsThenRefuses(EnvServer):
    """Runs a batch's steps, then refuses it for a repeated session: the refusal changed something."""

    async def step_batch(self, req):
        actions = {item.session_id: item.action for item in req.steps}
        if len(actions) == len(req.steps):
            return await super().step_batch(req)
        await asyncio.gather(*(self.step(sid, action) for sid, action in actions.items()))
        raise HTTPError(400, "bad_request", "steps: each session may appear once per batch")


class ActionLimitOffByOne(EnvServer):
    async def step(self, sid, action):
        return await super().step(sid, action[:-1] if len(action) == self.cfg.max_action_chars + 1 else action)


EPISODE_END, SAME_SEED, BATCH, LIFECYCLE = (
    "episode end (409 episode_over)",
    "same seed, same episode",
    "batched step",
    "session lifecycle",
)
ACTION_LIMIT, OPTIONAL, IDLE = (
    "action limit (400 action_too_long)",
    "kwargs, seed and options may be absent or null",
    "idle sessions expire",
)


@pytest.mark.process
@pytest.mark.parametrize(
    "server_class, failing",
    [
        (NoEpisodeEnd, [EPISODE_END]),
        # every check that replays a seed
        (SeedIgnored, [SAME_SEED, BATCH, "malformed bodies (400)", "concurrent sessions", V2_SINGLE]),
        (RacyCap, ["session cap (429)"]),
        (BatchOutOfOrder, [BATCH]),
        (CloseKeepsTheSession, [LIFECYCLE, "session cap (429)", IDLE, *V2_NAMES]),  # closed sessions fill the cap
        (ActionLimitOffByOne, [ACTION_LIMIT]),
        (SeedRequired, [OPTIONAL, "unknown env and session (404)"]),  # it asks for a seed before the env id
        (ActionBytesCounted, [ACTION_LIMIT]),
        (NoIdleExpiry, [IDLE]),
        (BatchStepsThenRefuses, [BATCH]),
    ],
    ids=lambda case: case.__name__ if isinstance(case, type) else "-".join(w.split()[0] for w in case),
)
def test_a_broken_rule_fails_its_check(server_class, failing):
    with serving(server_class) as url:  # three turns: a step that should not have happened shows
        report = check_env_server(url, env_id=ARITHMETIC, kwargs={"max_turns": 3})
    assert report.failed == failing, report.lines()


def one_request_at_a_time(app):
    """``app`` serving one request at a time, from its start to its reply, as a server with one request thread
    does (uvicorn reads headers before the app sees a request, so it is a slow body that holds the others)."""
    lock = asyncio.Lock()

    async def serve(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        async with lock:
            await app(scope, receive, send)

    return serve


@pytest.mark.process
def test_a_server_that_slow_clients_stall_fails_the_slow_client_check():
    with serving(EnvServer, wrap=one_request_at_a_time) as url:
        report = check_env_server(url, env_id=ARITHMETIC, kwargs={"max_turns": 3})
    assert report.failed == ["slow clients do not stall the server"], report.lines()
    (line,) = [line for line in report.lines() if line.startswith("FAIL slow clients")]
    assert "GET /health on a new connection got no 200 within 1 s" in line


@pytest.mark.process
def test_without_limits_in_health_nothing_else_is_checked():
    with serving(NoLimitsInHealth) as url:
        report = check_env_server(url, env_id=ARITHMETIC)
    assert report.failed == ["health reports the protocol and limits"]
    assert len(report.skipped) == len(CHECKS) - 1


# -- v1-only servers, and v2 servers without a multi-agent env ----------------------------------------------------


class V1Only(EnvServer):
    """Says it speaks v1 only, as the C++ and Java SDK servers did before v2."""

    def health(self):
        health = super().health()
        health.pop("protocols", None)
        return {**health, "protocol": "v1"}


@pytest.mark.process
def test_a_v1_only_server_passes_on_v1_alone_under_strict_too(capsys):
    with serving(V1Only) as url:
        assert main(["check-env-server", url, "--env-id", ARITHMETIC, "--kwargs", '{"max_turns": 2}', "--strict"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS ") == len(CHECKS) - len(V2_NAMES)
    for name in V2_NAMES:
        assert f"SKIP {name}: the server speaks v1 only (/health protocols ['v1'])" in out
    assert "0 failed, 0 skipped" in out and "the server speaks v1 only, so its 10 v2 checks were not run" in out


@pytest.mark.process
def test_without_a_multi_agent_env_its_checks_say_which_flag_to_pass(monkeypatch, capsys):
    listed = [(env_id, about) for env_id, about in describe_envs() if env_id != DEBATE]
    monkeypatch.setattr(server_module, "describe_envs", lambda: listed)
    with serving(EnvServer) as url:
        argv = ["check-env-server", url, "--env-id", ARITHMETIC, "--kwargs", '{"max_turns": 2}']
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert f"SKIP v2: batched step: no multi-agent env to play (/v1/envs does not list {DEBATE}); pass " in out
        assert "PASS v2: owner tags, close by owner" in out and "0 failed, 7 skipped" in out
        assert main([*argv, "--strict"]) == 1
        assert main([*argv, "--multi-agent-env", DEBATE, "--multi-agent-kwargs", '{"rounds": 3}', "--strict"]) == 0
    assert f"multi-agent env {DEBATE})" in capsys.readouterr().out


@pytest.mark.process
def test_a_turn_based_env_passes_the_v2_checks():
    """Turns-v0 acts one agent at a time: a step with an action of an agent whose turn it is not is refused."""
    with EnvServerProcess(module="areal_agents.envs.testing", **LIMITS) as server:
        kwargs = {"num_agents": 3, "turns": 5}
        report = check_env_server(server.url, env_id=ARITHMETIC, multi_agent_env=TURNS, multi_agent_kwargs=kwargs)
    assert report.ok and not report.skipped and not report.not_spoken, report.lines()
    assert report.protocols == ["v1", "v2"] and report.multi_agent_env == TURNS


# -- the Python server with one v2 rule broken --------------------------------------------------------------------


class V1TakesMultiAgentEnvs(EnvServer):
    async def create(self, req):
        sid, _, (observation, info) = await self.open(req)
        return reply(SessionCreated, session_id=sid, observation=observation, info=info)


class OwnerClosesEverything(EnvServer):
    async def close_owner(self, owner):
        closed = len(self.sessions)
        for sid in list(self.sessions):
            await self.close(sid)
        return reply(OwnerClosed, owner=owner, closed=closed)


class V1ForgetsTheOwner(EnvServer):
    async def create(self, req):
        return await super().create(req.model_copy(update={"owner": None}))


class ActionLimitOnV1Only(EnvServer):
    def check_action(self, action, who="action"):
        if who == "action":
            super().check_action(action, who)


class MultiAgentEpisodesNeverEnd(EnvServer):
    """Never marks a multi-agent episode over: a step after its end is refused for its keys, not 409."""

    def ended(self, session):
        if not session.env.multi_agent:
            super().ended(session)


class V2SeedIgnored(EnvServer):
    async def open(self, req, multi_agent_ok=True):
        if multi_agent_ok:  # a v2 creation
            req = req.model_copy(update={"seed": random.randrange(10**6)})
        return await super().open(req, multi_agent_ok)


def lenient_keys(monkeypatch):
    """Actions go to the env whichever agents they name (the env refuses a wrong set: an env error)."""

    def check_actions(server, sid, session, actions):
        server.check_ready(sid, session)
        for agent, action in actions.items():
            server.check_action(action, f"the action of {agent!r}")

    monkeypatch.setattr(server_v2, "_check_actions", check_actions)


def batch_reversed(monkeypatch):
    step_batch = server_v2.step_batch

    async def reversed_batch(server, req):
        return reply(MultiBatchStepResult, results=(await step_batch(server, req)).results[::-1])

    monkeypatch.setattr(server_v2, "step_batch", reversed_batch)


def single_agent_named_player(monkeypatch):
    monkeypatch.setattr(server_v2, "SINGLE_AGENT", "player")
    monkeypatch.setattr(sessions, "SINGLE_AGENT", "player")


@pytest.mark.process
@pytest.mark.parametrize(
    "server_class, patch, failing",
    [
        (V1TakesMultiAgentEnvs, None, [V2_V1_REFUSES]),
        (OwnerClosesEverything, None, [V2_OWNER]),
        (V1ForgetsTheOwner, None, [V2_OWNER]),
        (ActionLimitOnV1Only, None, [V2_ACTION_LIMIT]),
        (MultiAgentEpisodesNeverEnd, None, [V2_END]),
        (V2SeedIgnored, None, [V2_SINGLE, V2_END, V2_SEED, V2_KEYS, V2_BATCH]),
        (EnvServer, lenient_keys, [V2_KEYS, V2_BATCH]),
        (EnvServer, batch_reversed, [V2_BATCH]),
        (EnvServer, single_agent_named_player, [V2_SINGLE]),
    ],
    ids=lambda case: getattr(case, "__name__", "") if callable(case) else "",
)
def test_a_broken_v2_rule_fails_its_check(server_class, patch, failing, monkeypatch):
    if patch:
        patch(monkeypatch)
    with serving(server_class) as url:
        report = check_env_server(url, env_id=ARITHMETIC, kwargs={"max_turns": 3}, checks=V2_CHECKS)
    assert report.failed == failing, report.lines()
