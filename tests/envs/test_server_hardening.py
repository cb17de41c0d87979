"""The env-step server trusts no client: a request imports nothing, the session cap holds under concurrency,
the client's mistakes are 4xx and every oversized body is 413. A user module that fails to import is one line.

The servers here run in this process (uvicorn on a thread, as a Ray env-server actor runs it): real HTTP,
without a child interpreter's start-up.
"""

import asyncio
import contextlib
import http.client
import json
import os
import sys
import uuid

import aiohttp
import pytest
from app_in_thread import serving_app

from areal_agents.cli import main
from areal_agents.config import EnvConfig
from areal_agents.envs.registry import import_env_module
from areal_agents.envs.runtime.backends import open_env_backend
from areal_agents.envs.runtime.server import EnvServer, ServerConfig, build_app
from areal_agents.errors import ArealAgentsError
from areal_agents.net import free_port

TESTING = "areal_agents.envs.testing"

USER_ENVS = """
import gymnasium as gym
from areal_agents.envs import TextEnv

open({marker!r}, "w").close()  # proof that this module was imported


class Picky(TextEnv):
    '''Repeats its word ``times`` times; validates nothing in the constructor (as many envs do).'''

    def __init__(self, times=1):
        super().__init__()
        self.times = times

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        start = int((options or {{}}).get("start", 0))  # a ValueError for a start that is not a number
        return "word " * self.times + str(start), {{}}  # a TypeError for times="2"

    def step(self, action):
        return "", 1.0, True, False, {{}}


class Broken(Picky):
    '''Its reset fails for a reason of its own: an env error, not the client's.'''

    def reset(self, *, seed=None, options=None):
        raise RuntimeError("the env's own bug")
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A fresh importable module (name, marker path): the marker file exists once it has been imported."""
    name = f"user_envs_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / f"{name}.imported"
    (tmp_path / f"{name}.py").write_text(USER_ENVS.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, marker
    sys.modules.pop(name, None)


@contextlib.contextmanager
def serving(**options):
    """An env server on a free port in this process, stopped on exit."""
    port = free_port()
    with serving_app(build_app(EnvServer(ServerConfig(port=port, **options))), port):
        yield port


def request(port, method, path, payload=None, **send):
    """``payload`` as JSON, or what ``send`` gives http.client (``body``, ``encode_chunked``)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    if payload is not None:
        send["body"] = json.dumps(payload).encode()
    conn.request(method, path, headers={"Content-Type": "application/json"}, **send)
    response = conn.getresponse()
    payload = json.loads(response.read() or b"{}")
    conn.close()
    return response.status, payload


def create(port, env_id, **fields):
    return request(port, "POST", "/v1/sessions", {"env_id": env_id, **fields})


# -- a request imports nothing ----------------------------------------------------------------------------


@pytest.mark.process
def test_an_env_id_naming_a_module_imports_nothing(user_module):
    name, marker = user_module
    with serving(modules=[TESTING]) as port:
        for env_id in (f"{name}:Picky", f"{name}:areal_agents/Arithmetic-v0"):
            status, body = create(port, env_id)
            assert status == 404 and body["error"]["type"] == "unknown_env", body
            assert f"--module {name}" in body["error"]["message"]
        # nor through an env that makes an inner env by id from its kwargs
        status, body = create(port, "areal_agents/Debate-v0", kwargs={"task_env": f"{name}:Picky"})
        assert status == 404 and body["error"]["type"] == "unknown_env", body
    assert not marker.exists() and name not in sys.modules


@pytest.mark.process
def test_module_class_ids_resolve_in_modules_imported_at_start(user_module):
    """A run's ``env.id=module:Class`` (with or without ``env.module``): its server imports the module at start."""
    from areal_agents.envs.registry import modules_for

    name, marker = user_module
    assert modules_for(f"{name}:Picky") == [name]
    assert modules_for(f"{name}:Picky", "other") == ["other", name]
    assert modules_for("areal_agents/Arithmetic-v0", "") == []
    with serving(modules=modules_for(f"{name}:Picky")) as port:
        assert marker.exists()
        status, body = create(port, f"{name}:Picky", kwargs={"times": 2}, seed=0)
        assert status == 200 and body["observation"] == "word word 0", body
        debate = {"env_id": "areal_agents/Debate-v0", "kwargs": {"task_env": f"{name}:Picky"}}
        status, body = request(port, "POST", "/v2/sessions", debate)  # a multi-agent env: v2
        assert status == 200, body


@pytest.mark.process
def test_env_kwargs_naming_an_object_pick_it_only_from_start_up_modules():
    """Math-v0's ``reward`` names a ``module:attr``: ``builtins:exec`` with ``reward_mode=inline`` would make
    the server exec every action the client sends. Within a request, only a --module may be named."""
    with serving() as port:
        kwargs = {"reward": "builtins:exec", "reward_mode": "inline"}
        status, body = create(port, "areal_agents/Math-v0", kwargs=kwargs)
        assert status == 400 and "--module builtins" in body["error"]["message"], body


@pytest.mark.process
def test_a_run_through_its_own_env_server_serves_its_module_class_id(user_module, tmp_path, monkeypatch):
    """``env.backend=server`` with ``env.id=module:Class`` and no ``env.module``: the run's server imports it."""
    name, _ = user_module
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    backend = open_env_backend(EnvConfig(id=f"{name}:Picky", backend="server", workers=1))

    async def check():
        try:
            await backend.check()
        finally:
            await backend.aclose()

    asyncio.run(check())


# -- the session cap ---------------------------------------------------------------------------------------


@pytest.mark.process
def test_session_cap_holds_under_concurrent_creations():
    async def creations(port, n):
        async with aiohttp.ClientSession() as client:

            async def one():
                url = f"http://127.0.0.1:{port}/v1/sessions"
                async with client.post(url, json={"env_id": "areal_agents_testing/Echo-v0"}) as response:
                    return response.status, await response.json()

            return await asyncio.gather(*(one() for _ in range(n)))

    with serving(modules=[TESTING], max_sessions=50) as port:
        results = asyncio.run(creations(port, 200))
        statuses = [status for status, _ in results]
        assert statuses.count(200) == 50 and statuses.count(429) == 150, sorted(set(statuses))
        assert all(body["error"]["type"] == "too_many_sessions" for status, body in results if status == 429)
        assert request(port, "GET", "/health")[1]["sessions_open"] == 50


# -- the client's mistakes are 4xx -------------------------------------------------------------------------


@pytest.mark.process
@pytest.mark.parametrize("mode", ["thread", "process"])  # process: the error crosses from a worker process
def test_bad_seed_kwargs_and_options_are_400_and_an_env_bug_stays_500(user_module, mode):
    name, _ = user_module
    with serving(modules=[name], mode=mode, workers=1) as port:
        status, body = create(port, f"{name}:Picky", seed=-1)
        assert status == 400 and body["error"]["type"] == "bad_request", body
        assert "body.seed" in body["error"]["message"]
        status, body = create(port, f"{name}:Picky", kwargs={"times": "2"})
        assert status == 400 and body["error"]["type"] == "bad_request", body
        assert "TypeError" in body["error"]["message"] and "kwargs" in body["error"]["message"]
        status, body = create(port, f"{name}:Picky", options={"start": "one"})
        assert status == 400 and body["error"]["type"] == "bad_request", body
        assert "ValueError" in body["error"]["message"]
        status, body = create(port, f"{name}:Broken")
        assert status == 500 and body["error"]["type"] == "env_error", body
        assert request(port, "GET", "/health")[1]["sessions_open"] == 0


# -- every oversized body is 413 ---------------------------------------------------------------------------


@pytest.mark.process
def test_every_oversized_body_is_413_with_the_documented_shape():
    def chunks(total, size=1000):
        payload = json.dumps({"env_id": "areal_agents_testing/Echo-v0", "kwargs": {"target": "x" * total}}).encode()
        return iter([payload[i : i + size] for i in range(0, len(payload), size)])

    with serving(modules=[TESTING], max_body_bytes=4096) as port:
        sent = {
            "chunked": {"body": chunks(5000), "encode_chunked": True},
            "with Content-Length": {"body": json.dumps({"env_id": "x" * 5000}).encode()},
        }
        for how, send in sent.items():
            status, body = request(port, "POST", "/v1/sessions", **send)
            assert status == 413, (how, body)
            assert body == {"error": {"type": "payload_too_large", "message": body["error"]["message"]}}
            assert "4096 bytes" in body["error"]["message"]
        status, body = request(port, "POST", "/v1/sessions", body=chunks(100), encode_chunked=True)
        assert status == 200 and body["observation"] == f"Say {'x' * 100}.", body  # a small chunked body is fine


# -- a user module that fails to import is one line --------------------------------------------------------

FAILING_MODULES = {
    "RuntimeError": ("import os\n\nraise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here", ".py:3"),
    "SyntaxError": ("x = 1\n\ndef broken(:\n    pass\n", "SyntaxError: ", ".py:3"),
}


@pytest.mark.parametrize("kind", FAILING_MODULES)
def test_a_module_that_raises_while_importing_is_one_line_exit_2(tmp_path, monkeypatch, capsys, kind):
    source, error, where = FAILING_MODULES[kind]
    name = f"failing_{kind.lower()}_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ArealAgentsError) as e:
        import_env_module(name)
    message = str(e.value)
    assert name in message and error in message and f"{name}{where}" in message
    for command in (["serve-env", "--module", name], ["envs", "--module", name]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and error in err and "Traceback" not in err
