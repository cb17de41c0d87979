"""serve-tinker's HTTP contract, in process (FastAPI's TestClient): client mistakes are 400s naming the field
with a body (never empty, never 409/429/5xx), unknown ids 404, a finished session's heartbeat 410, the key
checked, creations posted twice answered once, futures long-polled (try_again) and results in protobuf."""

import asyncio

import pytest
from fastapi.testclient import TestClient

from areal_agents.tinker._vendor import tinker_public_pb2 as pb
from areal_agents.tinker.backend import TinkerService
from areal_agents.tinker.ownership import BaseModels
from areal_agents.tinker.rest import build_app

KEY = {"X-API-Key": "tml-test"}


@pytest.fixture
def app(tiny_dir, tmp_path):
    service = TinkerService(BaseModels({"tiny": tiny_dir}, allow_tiny=False), tmp_path / "ckpt")
    return service, build_app(service, poll_s=0.2)


@pytest.fixture
def client(app):
    with TestClient(app[1], headers=KEY) as c:
        yield c


def post(client, route, body, status=200):
    reply = client.post(f"/api/v1/{route}", json=body)
    assert reply.status_code == status, reply.text
    return reply.json()


def session(client) -> str:
    return post(client, "create_session", {"tags": [], "type": "create_session", "sdk_version": "0.38.0"})["session_id"]


def create_body(sid, seq=0, rank=4):
    return {"session_id": sid, "model_seq_id": seq, "base_model": "tiny", "lora_config": {"rank": rank}}


def result(client, reply):
    """The future's outcome, polled as the SDK polls (again after each try_again: the app holds 0.2 s)."""
    for _ in range(600):
        out = post(client, "retrieve_future", {"request_id": reply["request_id"], "allow_metadata_only": True})
        if out.get("type") != "try_again":
            return out
    raise AssertionError(f"{reply['request_id']} still pending after 120 s")


def test_the_api_key_is_checked(app):
    with TestClient(app[1]) as c:
        assert c.get("/api/v1/healthz").json() == {"status": "ok"}
        assert "X-API-Key" in c.post("/api/v1/create_session", json={}).json()["detail"]
        assert c.post("/api/v1/create_session", json={}, headers={"X-API-Key": "sk-x"}).status_code == 401
    with TestClient(build_app(app[0], api_key="tml-secret")) as c:
        assert c.post("/api/v1/create_session", json={}, headers=KEY).status_code == 401
        assert c.post("/api/v1/create_session", json={}, headers={"X-API-Key": "tml-secret"}).status_code == 200


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("create_model", {"model_seq_id": 0, "base_model": "tiny"}, "session_id"),
        ("create_model", "SID|lora_config.rank", "lora_config.rank"),
        ("create_model", "SID|base_model", "base_model"),
        ("optim_step", {"model_id": "x", "adam_params": {"learning_rate": -1}}, "adam_params.learning_rate"),
        ("asample", {"sampling_session_id": "x", "prompt": {"chunks": []}, "sampling_params": {}}, "prompt.chunks"),
        ("create_session", {"nonsense": 1}, "nonsense"),
    ],
)
def test_client_mistakes_are_400s_naming_the_field(client, route, body, field):
    sid = session(client)
    if body == "SID|lora_config.rank":
        body = {**create_body(sid), "lora_config": {"rank": "eight"}}
    elif body == "SID|base_model":
        body = {**create_body(sid), "base_model": "tiny-nope"}
    assert post(client, route, body, 400)["detail"].startswith(field)


def test_bodies_that_do_not_parse_are_400s_with_a_body(client):
    reply = client.post("/api/v1/create_session", content=b"{not json")
    assert reply.status_code == 400 and reply.json()["detail"].startswith("body")
    reply = client.post("/api/v1/forward_backward", content=b"\xff\xff\xff", headers={"content-type": "x"})
    assert reply.status_code == 400 and reply.json()["detail"].startswith("body")


def test_unknown_ids_are_404s_and_a_finished_session_heartbeat_410(client):
    sid = session(client)
    assert post(client, "session_heartbeat", {"session_id": sid}) == {"type": "session_heartbeat"}
    assert "model_id" in post(client, "get_info", {"model_id": f"{sid}:train:9"}, 404)["detail"]
    assert "request_id" in post(client, "retrieve_future", {"request_id": "req-999"}, 404)["detail"]
    assert client.get("/api/v1/samplers/nope").status_code == 404
    post(client, f"sessions/{sid}/finish", {"reason": {"type": "success"}})
    post(client, "session_heartbeat", {"session_id": sid}, 410)
    post(client, "create_model", create_body(sid), 404)


def test_a_creation_posted_again_gets_the_first_answer(client):
    sid = session(client)
    first = post(client, "create_model", create_body(sid))
    assert post(client, "create_model", create_body(sid)) == first  # the SDK's re-post after a lost reply
    assert "model_seq_id" in post(client, "create_model", create_body(sid, rank=8), 400)["detail"]
    assert result(client, first) == {"model_id": f"{sid}:train:0", "type": "create_model"}
    info = post(client, "get_info", {"model_id": f"{sid}:train:0"})
    assert info["lora_rank"] == 4 and info["model_data"]["model_name"] == "tiny"
    body = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": "tiny"}
    sampler = post(client, "create_sampling_session", body)
    assert post(client, "create_sampling_session", body) == sampler


def test_a_pending_future_is_held_then_try_again(app, client):
    service = app[0]

    async def slow() -> dict:
        await asyncio.sleep(30)
        return {}

    request_id = client.portal.call(service.futures.submit, slow, "owner")
    reply = post(client, "retrieve_future", {"request_id": request_id})
    assert reply == {"type": "try_again", "request_id": request_id, "queue_state": "active"}


def test_sample_results_come_back_as_protobuf_and_failures_as_user_errors(client):
    sid = session(client)
    body = {"session_id": sid, "sampling_session_seq_id": 0, "base_model": "tiny"}
    sampler_id = post(client, "create_sampling_session", body)["sampling_session_id"]
    assert client.get(f"/api/v1/samplers/{sampler_id}").json() == {"sampler_id": sampler_id, "base_model": "tiny"}
    ask = {"sampling_session_id": sampler_id, "num_samples": 2, "prompt": {"chunks": [{"tokens": [5, 6, 7]}]}}
    future = post(client, "asample", {**ask, "sampling_params": {"max_tokens": 3, "temperature": 0}})
    assert len(future["sample_sequence_ids"]) == 2
    reply = client.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]})
    while reply.headers["content-type"] == "application/json":  # try_again
        reply = client.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]})
    assert reply.headers["content-type"] == "application/x-protobuf"
    out = pb.SampleResponse.FromString(reply.content)
    assert len(out.sequences) == 2 and all(len(s.tokens) == 3 * 4 for s in out.sequences)  # int32 bytes
    ask["prompt"] = {"chunks": [{"tokens": [10**6]}]}  # out of the vocabulary: found while running
    failed = result(client, post(client, "asample", {**ask, "sampling_params": {"max_tokens": 3}}))
    assert failed["category"] == "user" and "prompt" in failed["error"]


def test_a_body_over_the_limit_is_413_however_it_is_sent(app):
    """A declared length over the cap, and a chunked body with no length, are both refused while read."""
    small = build_app(app[0], max_body_bytes=1000)
    with TestClient(small, headers=KEY) as c:
        declared = c.post("/api/v1/create_session", content=b"x" * 5000)
        chunked = c.post("/api/v1/create_session", content=(b"x" * 500 for _ in range(10)))
    assert declared.status_code == chunked.status_code == 413
    assert "at most 1000 bytes" in chunked.json()["detail"]


def test_a_body_nested_past_the_parser_or_with_a_lone_surrogate_is_a_400(client):
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    for body in (deep, b'{"tags": ["\\ud800"]}'):
        reply = client.post("/api/v1/create_session", content=body)
        assert reply.status_code == 400 and reply.json()["detail"].startswith("body:")
