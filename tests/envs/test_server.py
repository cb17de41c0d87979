"""The env-step server over real HTTP: bad input gets a 4xx naming the problem, faults stay contained."""

import asyncio
import http.client
import json
import time

import pytest

from areal_agents.envs.runtime.remote import EnvServerProcess, RemoteEnvPool
from areal_agents.errors import EnvError, UnknownEnvError

TESTING = "areal_agents.envs.testing"


@pytest.fixture(scope="module")
def server():
    with EnvServerProcess(
        mode="thread",
        workers=4,
        step_timeout=1.0,
        max_sessions=20,
        max_action_chars=100,
        max_body_bytes=4096,
        module=TESTING,
    ) as s:
        yield s


def request(server, method, path, body=None, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = json.loads(response.read() or b"{}")
    conn.close()
    return response.status, payload


def create(server, env_id="areal_agents_testing/Faulty-v0", **kw):
    status, body = request(server, "POST", "/v1/sessions", {"env_id": env_id, "seed": 0, **kw})
    assert status == 200, body
    return body["session_id"]


def open_sessions(server):
    return request(server, "GET", "/health")[1]["sessions_open"]


@pytest.mark.process
def test_episode_and_listing(server):
    status, envs = request(server, "GET", "/v1/envs")
    ids = {e["id"]: e["description"] for e in envs["envs"]}
    assert "areal_agents/Arithmetic-v0" in ids and ids["areal_agents_testing/Echo-v0"].startswith("Echo")
    sid = create(server, "areal_agents/Arithmetic-v0", kwargs={"max_turns": 2})
    status, result = request(server, "POST", f"/v1/sessions/{sid}/step", {"action": "0"})
    assert status == 200 and result["terminated"] is False and result["observation"].startswith("Wrong.")
    assert request(server, "DELETE", f"/v1/sessions/{sid}")[1] == {"session_id": sid, "closed": True}


@pytest.mark.process
@pytest.mark.parametrize(
    "method, path, body, raw, status, type_, text",
    [
        ("POST", "/v1/sessions", None, b"{not json", 400, "bad_request", "JSON"),
        ("POST", "/v1/sessions", {"env_id": 5}, None, 400, "bad_request", "body.env_id"),
        ("POST", "/v1/sessions", {"env_id": "x", "colour": 1}, None, 400, "bad_request", "body.colour"),
        (
            "POST",
            "/v1/sessions",
            {"env_id": "areal_agents/Arithmetik-v0"},
            None,
            404,
            "unknown_env",
            "Did you mean 'areal_agents/Arithmetic-v0'",
        ),
        (
            "POST",
            "/v1/sessions",
            {"env_id": "areal_agents/Arithmetic-v0", "kwargs": {"digits": 0}},
            None,
            400,
            "bad_request",
            "digits",
        ),
        ("POST", "/v1/sessions/nope/step", {"action": "hi"}, None, 404, "unknown_session", "'nope'"),
        ("DELETE", "/v1/sessions/nope", None, None, 404, "unknown_session", "'nope'"),
        (
            "POST",
            "/v1/sessions",
            None,
            json.dumps({"env_id": "x" * 5000}).encode(),
            413,
            "payload_too_large",
            "4096 bytes",
        ),
    ],
)
def test_bad_requests_are_4xx_naming_the_problem(server, method, path, body, raw, status, type_, text):
    got_status, got = request(server, method, path, body, raw)
    assert got_status == status
    assert got["error"]["type"] == type_ and text in got["error"]["message"]
    assert request(server, "GET", "/health")[0] == 200  # still serving


@pytest.mark.process
def test_action_over_limit_and_finished_episode(server):
    sid = create(server)
    status, body = request(server, "POST", f"/v1/sessions/{sid}/step", {"action": "a" * 101})
    assert status == 400 and body["error"]["type"] == "action_too_long" and "limit is 100" in body["error"]["message"]
    status, body = request(server, "POST", f"/v1/sessions/{sid}/step", {"action": "hi"})
    assert status == 200 and body["terminated"] is True and body["reward"] == 1.0
    status, body = request(server, "POST", f"/v1/sessions/{sid}/step", {"action": "hi"})
    assert status == 409 and body["error"]["type"] == "episode_over"
    request(server, "DELETE", f"/v1/sessions/{sid}")


@pytest.mark.process
def test_faults_end_only_their_episode(server):
    before = open_sessions(server)
    healthy = create(server)
    for action, kind in (("raise", "env_error"), ("hang", "timeout")):
        sid = create(server)
        status, body = request(server, "POST", f"/v1/sessions/{sid}/step", {"action": action})
        assert status == 200 and body["error"]["type"] == kind and body["terminated"] is True
        assert request(server, "POST", f"/v1/sessions/{sid}/step", {"action": "hi"})[0] == 404  # gone
    status, body = request(server, "POST", f"/v1/sessions/{healthy}/step", {"action": "x"})
    assert status == 200 and body["error"] is None  # the other session carries on
    request(server, "DELETE", f"/v1/sessions/{healthy}")
    assert open_sessions(server) == before
    errors = request(server, "GET", "/metrics")[1]["errors"]
    assert errors["env_error"] >= 1 and errors["timeout"] >= 1


@pytest.mark.process
def test_batched_step_mixes_results_and_errors(server):
    a, b = create(server), create(server)
    status, body = request(
        server,
        "POST",
        "/v1/step",
        {
            "steps": [
                {"session_id": a, "action": "hi"},
                {"session_id": b, "action": "raise"},
                {"session_id": "nope", "action": "hi"},
            ]
        },
    )
    assert status == 200
    ok, failed, missing = body["results"]
    assert ok["reward"] == 1.0 and ok["error"] is None
    assert failed["error"]["type"] == "env_error"
    assert missing["error"]["type"] == "unknown_session"
    request(server, "DELETE", f"/v1/sessions/{a}")


@pytest.mark.process
def test_session_cap_is_429_and_sessions_do_not_leak(server):
    before = open_sessions(server)
    ids = []
    while True:
        status, body = request(server, "POST", "/v1/sessions", {"env_id": "areal_agents_testing/Echo-v0"})
        if status != 200:
            break
        ids.append(body["session_id"])
    assert (
        status == 429 and body["error"]["type"] == "too_many_sessions" and "--max-sessions" in body["error"]["message"]
    )
    assert len(ids) + before == 20
    for sid in ids:
        request(server, "DELETE", f"/v1/sessions/{sid}")
    assert open_sessions(server) == before


@pytest.mark.process
def test_idle_sessions_expire():
    with EnvServerProcess(idle_timeout=0.3, module=TESTING) as s:
        create(s, "areal_agents_testing/Echo-v0")
        assert open_sessions(s) == 1
        time.sleep(1.0)
        assert open_sessions(s) == 0
        assert request(s, "GET", "/metrics")[1]["sessions_expired"] == 1


@pytest.mark.process
def test_dead_worker_process_fails_only_its_episode():
    with EnvServerProcess(mode="process", workers=2, module=TESTING) as s:
        other = create(s)
        sid = create(s)
        status, body = request(s, "POST", f"/v1/sessions/{sid}/step", {"action": "die"})
        assert status == 200 and body["error"]["type"] == "worker_died"
        status, body = request(s, "POST", f"/v1/sessions/{other}/step", {"action": "hi"})
        assert status == 200 and body["reward"] == 1.0
        assert request(s, "GET", "/health")[0] == 200


@pytest.mark.process
@pytest.mark.parametrize("batch_steps", [True, False])
def test_remote_env_client(server, batch_steps):
    async def run():
        pool = RemoteEnvPool(server.url, batch_steps=batch_steps)
        try:
            envs = [pool.make("areal_agents/Arithmetic-v0") for _ in range(8)]
            firsts = await asyncio.gather(*(e.areset(seed=i) for i, e in enumerate(envs)))
            steps = await asyncio.gather(*(e.astep("0") for e in envs))
            await asyncio.gather(*(e.aclose() for e in envs))
            faulty = pool.make("areal_agents_testing/Faulty-v0")
            await faulty.areset(seed=0)
            with pytest.raises(EnvError) as err:
                await faulty.astep("raise")
            with pytest.raises(UnknownEnvError):
                await pool.make("areal_agents/Nope-v0").areset()
            return firsts, steps, err.value.kind
        finally:
            await pool.aclose()

    firsts, steps, kind = asyncio.run(run())
    from areal_agents.envs import make_env

    plain = make_env("areal_agents/Arithmetic-v0")
    assert firsts == [plain.reset(seed=i) for i in range(8)]
    assert all(s[2] is True for s in steps) and kind == "env_error"
    assert open_sessions(server) == 0


def test_unreachable_server_is_a_typed_error():
    async def run():
        pool = RemoteEnvPool("http://127.0.0.1:9")
        try:
            await pool.make("areal_agents/Arithmetic-v0").areset()
        finally:
            await pool.aclose()

    with pytest.raises(EnvError, match="unreachable"):  # an env failure: the episode is retried
        asyncio.run(run())


@pytest.mark.process
def test_openapi_documents_every_route(server):
    status, spec = request(server, "GET", "/openapi.json")
    assert status == 200
    for path in (
        "/v1/sessions",
        "/v1/sessions/{session_id}/step",
        "/v1/sessions/{session_id}",
        "/v1/step",
        "/v1/envs",
        "/health",
        "/metrics",
    ):
        assert path in spec["paths"], path
    schemas = spec["components"]["schemas"]
    assert {"CreateSession", "StepResult", "BatchStepRequest", "ErrorResponse"} <= set(schemas)


@pytest.mark.process
def test_an_unknown_env_id_is_answered_with_the_ids_served(server):
    status, body = request(server, "POST", "/v1/sessions", {"env_id": "cpp/GuessNumber-v0"})
    message = body["error"]["message"]
    assert status == 404 and "unknown env id 'cpp/GuessNumber-v0'" in message
    served = message.split("This server serves: ")[1].split(", ")
    assert "areal_agents/Arithmetic-v0" in served and "areal_agents_testing/Echo-v0" in served
