"""Protocol v2 over real HTTP: multi-agent sessions (Debate-v0, the turn-based Turns-v0), a single-agent env as
agent "agent", batched steps, closing by owner, and every refusal a 4xx naming what is wrong."""

import http.client
import json

import pytest

from areal_agents.envs.runtime.remote import EnvServerProcess

pytestmark = pytest.mark.process

TESTING = "areal_agents.envs.testing"
DEBATE = {"env_id": "areal_agents/Debate-v0", "kwargs": {"rounds": 2, "task_kwargs": {"digits": 1}}}


@pytest.fixture(scope="module")
def server():
    with EnvServerProcess(mode="thread", workers=2, max_action_chars=100, max_sessions=40, module=TESTING) as s:
        yield s


def request(server, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = json.loads(response.read() or b"{}")
    conn.close()
    return response.status, payload


def create(server, body=DEBATE, **kw):
    status, created = request(server, "POST", "/v2/sessions", {**body, "seed": 0, **kw})
    assert status == 200, created
    return created


def step(server, sid, actions):
    return request(server, "POST", f"/v2/sessions/{sid}/step", {"actions": actions})


def open_sessions(server):
    return request(server, "GET", "/health")[1]["sessions_open"]


def test_health_lists_both_versions(server):
    status, health = request(server, "GET", "/health")
    assert status == 200 and health["protocol"] == "v2" and health["protocols"] == ["v1", "v2"]
    assert health["limits"]["max_action_chars"] == 100  # the v1 fields, unchanged


def test_a_debate_episode(server):
    created = create(server)
    sid = created["session_id"]
    assert created["multi_agent"] is True and created["agents"] == ["debater_0", "debater_1"]
    assert created["acting"] == ["debater_0", "debater_1"]
    question = created["observations"]["debater_0"]
    assert question == created["observations"]["debater_1"] and question.endswith("=")
    right = str(eval(question.rstrip("=")))  # the arithmetic task: "a+b="
    status, result = step(server, sid, {"debater_0": right, "debater_1": "x"})
    assert status == 200 and result["error"] is None and result["acting"] == ["debater_0", "debater_1"]
    assert "debater_1: x" in result["observations"]["debater_0"]
    assert result["terminations"] == {"debater_0": False, "debater_1": False}
    status, result = step(server, sid, {"debater_0": right, "debater_1": right})
    assert status == 200 and result["acting"] == [] and result["rewards"] == {"debater_0": 1.0, "debater_1": 1.0}
    assert result["terminations"] == {"debater_0": True, "debater_1": True}
    assert result["infos"]["debater_0"]["majority_correct"] is True
    status, error = step(server, sid, {"debater_0": "1", "debater_1": "1"})
    assert status == 409 and error["error"]["type"] == "episode_over"
    assert request(server, "DELETE", f"/v2/sessions/{sid}")[1] == {"session_id": sid, "closed": True}


def test_a_turn_based_env_names_one_speaker_at_a_time(server):
    created = create(server, {"env_id": "areal_agents_testing/Turns-v0", "kwargs": {"num_agents": 3, "turns": 4}})
    sid = created["session_id"]
    assert created["agents"] == ["p0", "p1", "p2"] and created["acting"] == ["p0"]
    assert set(created["observations"]) == {"p0", "p1", "p2"}  # everyone is told the rules
    status, error = step(server, sid, {"p0": "hi", "p1": "hi"})  # p1 speaks out of turn
    assert (
        status == 400 and "missing []" in error["error"]["message"] and "unexpected ['p1']" in error["error"]["message"]
    )
    order = []
    acting = created["acting"]
    while acting:
        order.append(acting[0])
        status, result = step(server, sid, {acting[0]: "hi"})
        assert status == 200, result
        assert result["rewards"] == {acting[0]: 1.0}
        acting = result["acting"]
        if acting:  # the listeners hear the speaker
            assert set(result["observations"]) == {"p0", "p1", "p2"} - {order[-1]}
            assert result["observations"][acting[0]] == f"{order[-1]}: hi"
    assert order == ["p0", "p1", "p2", "p0"]
    assert result["terminations"] == {"p0": True, "p1": True, "p2": True}  # every agent, at the end
    request(server, "DELETE", f"/v2/sessions/{sid}")


def test_a_single_agent_env_is_agent_agent_and_keeps_its_v1_steps(server):
    created = create(server, {"env_id": "areal_agents_testing/Echo-v0", "kwargs": {"max_turns": 3}})
    sid = created["session_id"]
    assert created["multi_agent"] is False and created["agents"] == ["agent"] and created["acting"] == ["agent"]
    assert created["observations"] == {"agent": "Say hi."} and created["infos"] == {"agent": {"role": "user"}}
    status, result = step(server, sid, {"agent": "no"})
    assert status == 200 and result["observations"] == {"agent": "no"} and result["acting"] == ["agent"]
    assert result["rewards"] == {"agent": 0.0} and result["infos"] == {"agent": {"turn": 1}}
    status, result = request(server, "POST", f"/v1/sessions/{sid}/step", {"action": "hi"})  # v1, on the same one
    assert status == 200 and result["reward"] == 1.0 and result["terminated"] is True
    status, error = step(server, sid, {"agent": "hi"})
    assert status == 409 and error["error"]["type"] == "episode_over"
    request(server, "DELETE", f"/v1/sessions/{sid}")


def test_refusals_are_4xx_naming_the_problem_and_change_nothing(server):
    sid = create(server)["session_id"]
    refusals = [
        ({"debater_0": "1"}, 400, "bad_request", "missing ['debater_1'], unexpected []"),
        ({"debater_0": "1", "debater_1": "1", "judge": "1"}, 400, "bad_request", "unexpected ['judge']"),
        ({}, 400, "bad_request", "missing ['debater_0', 'debater_1']"),
        ({"debater_0": "1", "debater_1": "y" * 101}, 400, "action_too_long", "'debater_1' is 101 characters"),
    ]
    for actions, status, type_, text in refusals:
        got, error = step(server, sid, actions)
        assert (got, error["error"]["type"]) == (status, type_) and text in error["error"]["message"], error
    got, error = request(server, "POST", f"/v2/sessions/{sid}/step", {"actions": {"debater_0": 5}})
    assert got == 400 and "body.actions.debater_0" in error["error"]["message"]
    got, error = request(server, "POST", f"/v2/sessions/{sid}/step", {"action": "1"})
    assert got == 400 and "body.actions" in error["error"]["message"]
    got, error = request(server, "POST", f"/v1/sessions/{sid}/step", {"action": "1"})  # multi-agent on v1
    assert got == 400 and f"/v2/sessions/{sid}/step" in error["error"]["message"]
    status, result = step(server, sid, {"debater_0": "1", "debater_1": "2"})  # still usable
    assert status == 200 and result["acting"] == ["debater_0", "debater_1"]
    got, error = step(server, "nope", {"debater_0": "1"})
    assert got == 404 and error["error"]["type"] == "unknown_session"
    request(server, "DELETE", f"/v2/sessions/{sid}")


@pytest.mark.parametrize(
    "method, path, body, status, text",
    [
        ("POST", "/v1/sessions", DEBATE, 400, "is a multi-agent env (agents ['debater_0', 'debater_1'])"),
        ("POST", "/v1/sessions", DEBATE, 400, "create it with POST /v2/sessions"),
        ("POST", "/v2/sessions", {**DEBATE, "owner": "a b"}, 400, "body.owner"),
        ("POST", "/v2/sessions", {**DEBATE, "owner": "x" * 129}, 400, "body.owner"),
        ("POST", "/v2/sessions", {**DEBATE, "owner": ""}, 400, "body.owner"),
        ("POST", "/v1/sessions", {"env_id": "areal_agents_testing/Echo-v0", "owner": "a/b"}, 400, "body.owner"),
        ("POST", "/v2/sessions", {**DEBATE, "colour": 1}, 400, "body.colour"),
        ("POST", "/v2/sessions", {"env_id": "areal_agents/Debate-v0", "kwargs": {"num_agents": 99}}, 400, "num_agents"),
        ("POST", "/v2/sessions", {"env_id": "areal_agents/Debat-v0"}, 404, "Did you mean 'areal_agents/Debate-v0'"),
        ("DELETE", "/v2/sessions", None, 400, "query.owner"),
        ("DELETE", "/v2/sessions?owner=a%20b", None, 400, "query.owner"),
        ("DELETE", "/v2/sessions/nope", None, 404, "nope"),
        ("POST", "/v2/step", {"steps": [{"session_id": "s", "actions": {}}] * 2}, 400, "once per batch"),
    ],
)
def test_create_and_close_refusals(server, method, path, body, status, text):
    got, error = request(server, method, path, body)
    assert got == status and text in error["error"]["message"], error


def test_batched_steps_carry_each_items_own_error(server):
    a, b = create(server)["session_id"], create(server)["session_id"]
    steps = [
        {"session_id": a, "actions": {"debater_0": "1", "debater_1": "2"}},
        {"session_id": b, "actions": {"debater_0": "1"}},  # refused alone
        {"session_id": "gone", "actions": {"x": "1"}},
    ]
    status, body = request(server, "POST", "/v2/step", {"steps": steps})
    assert status == 200 and [r["session_id"] for r in body["results"]] == [a, b, "gone"]
    ok, refused, unknown = body["results"]
    assert ok["error"] is None and ok["acting"] == ["debater_0", "debater_1"]
    assert refused["error"]["type"] == "bad_request" and refused["acting"] == []
    assert unknown["error"]["type"] == "unknown_session"
    status, result = step(server, b, {"debater_0": "1", "debater_1": "2"})  # b is still in its first round
    assert status == 200 and result["acting"] == ["debater_0", "debater_1"]
    for sid in (a, b):
        request(server, "DELETE", f"/v2/sessions/{sid}")


def test_close_by_owner_closes_that_owners_sessions_only(server):
    before = open_sessions(server)
    mine = [create(server, owner="run-1:a")["session_id"] for _ in range(2)]
    v1 = request(server, "POST", "/v1/sessions", {"env_id": "areal_agents_testing/Echo-v0", "owner": "run-1:a"})[1]
    other = create(server, owner="run-2")["session_id"]
    assert open_sessions(server) == before + 4
    status, body = request(server, "DELETE", "/v2/sessions?owner=run-1:a")
    assert status == 200 and body == {"owner": "run-1:a", "closed": 3}
    assert open_sessions(server) == before + 1
    for sid in [*mine, v1["session_id"]]:
        assert step(server, sid, {"agent": "x"})[0] == 404
    assert request(server, "DELETE", "/v2/sessions?owner=run-1:a")[1] == {"owner": "run-1:a", "closed": 0}
    request(server, "DELETE", f"/v2/sessions/{other}")


def test_process_mode_keeps_the_turn_order():
    with EnvServerProcess(mode="process", workers=2, module=TESTING) as s:
        created = create(s, {"env_id": "areal_agents_testing/Turns-v0", "kwargs": {"num_agents": 2, "turns": 3}})
        sid, acting, order = created["session_id"], created["acting"], []
        while acting:
            order.append(acting[0])
            status, result = step(s, sid, {acting[0]: "hi"})
            assert status == 200, result
            acting = result["acting"]
        assert order == ["p0", "p1", "p0"]
        debate = create(s)
        status, result = step(s, debate["session_id"], {"debater_0": "1", "debater_1": "2"})
        assert status == 200 and result["acting"] == ["debater_0", "debater_1"]
        status, error = request(s, "POST", "/v1/sessions", DEBATE)
        assert status == 400 and "/v2/sessions" in error["error"]["message"]
