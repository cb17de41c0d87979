"""The conformance suite (`check-env-server`): it passes against our Python server, and each rule broken on
purpose in a copy of that server is caught by the check for that rule, and by that check alone."""

import asyncio
import contextlib
import random
import threading
import time

import pytest
import uvicorn

from areal_agents.cli import main
from areal_agents.envs.runtime.conformance import CHECKS, check_env_server
from areal_agents.envs.runtime.remote import EnvServerProcess
from areal_agents.envs.runtime.server import EnvServer, HTTPError, ServerConfig, build_app
from areal_agents.net import free_port

ARITHMETIC = "areal_agents/Arithmetic-v0"
LIMITS = {"max_sessions": 16, "max_body_bytes": 65536, "max_action_chars": 1000}


@contextlib.contextmanager
def serving(server_class: type[EnvServer]):
    """``server_class`` behind the real app, on a free port in this process; its URL."""
    port = free_port()
    app = build_app(server_class(ServerConfig(port=port, workers=4, **LIMITS)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "env server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_python_server_passes_every_check():
    with EnvServerProcess(**LIMITS) as server:
        report = check_env_server(server.url, env_id=ARITHMETIC)
    assert report.ok and not report.skipped, report.lines()
    assert [r.name for r in report.results] == [name for name, _ in CHECKS]


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
        assert "0 failed, 4 skipped" in out
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
        return {"results": reply["results"][::-1]}


class CloseKeepsTheSession(EnvServer):
    """DELETE answers closed: true but the session lives on."""

    async def close(self, sid):
        self._get(sid)
        return {"session_id": sid, "closed": True}


class ActionLimitOffByOne(EnvServer):
    async def step(self, sid, action):
        return await super().step(sid, action[:-1] if len(action) == self.cfg.max_action_chars + 1 else action)


@pytest.mark.parametrize(
    "server_class, failing_check",
    [
        (NoEpisodeEnd, "episode end (409 episode_over)"),
        (NoLimitsInHealth, "health reports the protocol and limits"),
        (SeedIgnored, "same seed, same episode"),
        (RacyCap, "session cap (429)"),
        (BatchOutOfOrder, "batched step"),
        (CloseKeepsTheSession, "session lifecycle"),
        (ActionLimitOffByOne, "action limit (400 action_too_long)"),
    ],
)
def test_a_broken_rule_fails_its_check(server_class, failing_check):
    with serving(server_class) as url:
        report = check_env_server(url, env_id=ARITHMETIC)
    assert failing_check in report.failed, report.lines()
    if server_class is NoLimitsInHealth:  # without limits nothing else can be checked
        assert report.failed == [failing_check] and len(report.skipped) == len(CHECKS) - 1
    elif server_class in (SeedIgnored, CloseKeepsTheSession):  # replays and session counts depend on these rules
        assert set(report.failed) <= {failing_check, "concurrent sessions", "batched step", "session cap (429)"}
    else:
        assert report.failed == [failing_check] and not report.skipped, report.lines()
