"""The gateway over a real engine and a real socket, driven by the `openai` and `anthropic` SDKs unchanged:
sessions opened by route, header or path, calls captured token for token, rewards set after the session ended
(per session or per call) handing it to training; every client mistake a 4xx in its API's error shape."""

import asyncio
import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from openai import AsyncOpenAI

from areal_agents.config import GatewayConfig
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.models import load_model, load_tokenizer
from areal_agents.rollout.gateway.server import Gateway
from areal_agents.types import SamplingParams

pytestmark = pytest.mark.process

KEY, OTHER = "sk-test-aaaaaaaaaaaa", "sk-test-bbbbbbbbbbbb"


def serve(tiny_dir: Path, work, **cfg):
    """Run ``work(gateway, http)`` against a started gateway on the tiny model; return its result and the
    sessions handed to training."""
    ready = []

    async def main():
        engine = HFEngine(load_model(tiny_dir), max_batch_size=4, num_threads=1)
        tokenizer, sampling = load_tokenizer(tiny_dir), SamplingParams(6)
        gateway = Gateway(GatewayConfig(port=0, **cfg), engine, tokenizer, sampling, ready.append)
        await gateway.start()
        try:
            async with httpx.AsyncClient(base_url=gateway.url, headers={"x-api-key": KEY}) as http:
                return await work(gateway, http)
        finally:
            await gateway.stop()
            await engine.aclose()

    return asyncio.run(main()), ready


def loss_count(session) -> int:
    return sum(sum(t.loss_mask) for t in session.trajectories)


def test_a_session_of_sdk_calls_is_trained_once_its_late_reward_comes(tiny_dir):
    async def work(gateway, http):
        opened = (await http.post("/rl/sessions", json={"task": "add"})).json()
        client = AsyncOpenAI(base_url=opened["openai_base_url"], api_key="unused")
        messages = [{"role": "user", "content": "1+2="}]
        first = await client.chat.completions.create(model="m", messages=messages, logprobs=True)
        messages += [first.choices[0].message, {"role": "user", "content": "again"}]
        second = await client.chat.completions.create(model="m", messages=messages)
        ended = (await http.post(f"/rl/sessions/{opened['session_id']}/end")).json()
        waiting = gateway.stats()["open_sessions"]
        rewarded = await http.post(f"/rl/sessions/{opened['session_id']}/reward", json={"reward": 1.0})
        again = await http.post(f"/rl/sessions/{opened['session_id']}/reward", json={"reward": 0.0})
        return first, second, ended, waiting, rewarded, again

    (first, second, ended, waiting, rewarded, again), ready = serve(tiny_dir, work)
    assert ended["ended"] and waiting == 1 and rewarded.status_code == 200
    assert again.status_code == 409 and "handed to training" in again.json()["error"]["message"]
    (session,) = ready
    (traj,) = session.trajectories  # the second call extended the first: one token sequence
    assert loss_count(session) == first.usage.completion_tokens + second.usage.completion_tokens
    generated = [lp for lp, m in zip(traj.logprobs, traj.loss_mask) if m]
    sent = [c.logprob for c in first.choices[0].logprobs.content]
    assert generated[: len(sent)] == pytest.approx(sent, abs=1e-6)  # the logprobs the client saw are trained
    assert session.task == "add" and traj.metadata["task"] == "add" and traj.group_id == "task:add"
    assert {v for v, m in zip(traj.versions, traj.loss_mask) if m} == {0}


def test_header_sessions_per_call_rewards_and_calls_without_a_session(tiny_dir):
    async def work(gateway, http):
        client = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused")
        header = {"X-Session-Id": "user-7:chat-1", "X-Session-Task": "greeting"}
        ask = lambda h: client.chat.completions.create(  # noqa: E731
            model="m", messages=[{"role": "user", "content": "hi"}], extra_headers=h
        )
        a, b = await ask(header), await ask(header)
        await ask({})  # served, not captured
        await http.post("/rl/sessions/user-7:chat-1/end")
        await http.post("/rl/sessions/user-7:chat-1/reward", json={"reward": 0.5, "completion_id": a.id})
        waiting = gateway.stats()["handed_on"]  # one of its two calls has a reward
        await http.post("/rl/sessions/user-7:chat-1/reward", json={"reward": 1.0, "completion_id": b.id})
        return gateway.stats(), waiting

    (stats, waiting), ready = serve(tiny_dir, work)
    assert waiting == 0
    (session,) = ready
    assert session.reward == 1.5 and session.trajectories[0].turn_rewards == [0.5, 1.0] and session.task == "greeting"
    assert stats["unsessioned_calls"] == 1 and stats["calls"] == 2 and stats["handed_on"] == 1


def test_anthropic_messages_and_openai_responses_through_their_sdks(tiny_dir):
    async def work(gateway, http):
        a = (await http.post("/rl/sessions", json={"session_id": "claude-1"})).json()
        claude = anthropic.AsyncAnthropic(base_url=a["anthropic_base_url"], api_key=KEY)
        message = await claude.messages.create(
            model="policy", max_tokens=5, system="Add.", messages=[{"role": "user", "content": "1+2="}]
        )
        client = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY)
        response = await client.responses.create(
            model="policy", instructions="Add.", input="1+2=", extra_headers={"X-Session-Id": "resp-1"}
        )
        for sid, reward in (("claude-1", 1.0), ("resp-1", 0.0)):
            await http.post(f"/rl/sessions/{sid}/end")
            await http.post(f"/rl/sessions/{sid}/reward", json={"reward": reward})
        return message, response

    (message, response), ready = serve(tiny_dir, work)
    assert isinstance(message, anthropic.types.Message) and message.usage.output_tokens <= 5
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens >= 1
    by_id = {s.session_id: s for s in ready}
    assert loss_count(by_id["claude-1"]) == message.usage.output_tokens
    assert loss_count(by_id["resp-1"]) == response.usage.output_tokens
    assert (by_id["claude-1"].reward, by_id["resp-1"].reward) == (1.0, 0.0)


def test_client_mistakes_are_4xx_in_each_apis_shape(tiny_dir, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"{KEY}: {{name: app, requests_per_minute: 40}}\n{OTHER}: {{name: other}}\n")

    async def work(gateway, http):
        out = {}
        post = lambda path, **kw: http.post(path, **kw)  # noqa: E731
        chat = "/v1/chat/completions"
        out["not json"] = await post(chat, content=b"{nope")
        out["an array"] = await post(chat, json=[1])
        out["no messages"] = await post(chat, json={"model": "m"})
        out["stream"] = await post(chat, json={"messages": [{"role": "user", "content": "x"}], "stream": "yes"})
        out["too large"] = await post(chat, content=b"x" * 5000)
        out["bad session id"] = await post(chat, json={"messages": []}, headers={"X-Session-Id": "a b"})
        no_budget = {"messages": [{"role": "user", "content": "x"}]}
        out["anthropic no max_tokens"] = await post("/v1/messages", json=no_budget)
        out["no key"] = await httpx.AsyncClient(base_url=gateway.url).post(chat, json={})
        mine = (await post("/rl/sessions", json={})).json()["session_id"]
        out["another key's session"] = await post(f"/rl/sessions/{mine}/end", headers={"x-api-key": OTHER})
        out["reward NaN"] = await post(f"/rl/sessions/{mine}/reward", content=b'{"reward": NaN}')
        out["reward text"] = await post(f"/rl/sessions/{mine}/reward", json={"reward": "good"})
        out["no reward"] = await post(f"/rl/sessions/{mine}/reward", json={})
        out["unknown session"] = await post("/rl/sessions/nope/reward", json={"reward": 1})
        client = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0)
        try:  # 40 requests a minute for this key: the SDK's own error
            for _ in range(40):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        except openai.RateLimitError as e:
            out["rate limited"] = e.response
        claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="sk-wrong-key-0000000", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            await claude.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}])
        return out

    out, ready = serve(tiny_dir, work, api_keys_file=str(keys), max_body_bytes=4096)
    statuses = {name: r.status_code for name, r in out.items()}
    assert statuses == {
        "not json": 400, "an array": 400, "no messages": 400, "stream": 400, "too large": 413, "bad session id": 400,
        "anthropic no max_tokens": 400, "no key": 401, "another key's session": 403, "reward NaN": 400,
        "reward text": 400, "no reward": 400, "unknown session": 404, "rate limited": 429,
    }  # fmt: skip
    assert out["no messages"].json()["error"]["param"] == "messages"
    body = out["anthropic no max_tokens"].json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    assert ready == [] and all(json.loads(r.content) for r in out.values() if r.status_code != 413)


def test_streaming_clients_read_the_whole_reply_as_their_apis_events(tiny_dir):
    """``stream: true`` on each API: the SDKs' own stream readers assemble the same reply that is trained."""

    async def work(gateway, http):
        client = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused")
        head = {"X-Session-Id": "streamed"}
        messages = [{"role": "user", "content": "1+2="}]
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="m", messages=messages, stream=True, stream_options={"include_usage": True}, extra_headers=head
            )
        ]
        claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="unused", default_headers=head)
        async with claude.messages.stream(model="m", max_tokens=5, messages=messages) as stream:
            message = await stream.get_final_message()
        events = [
            e async for e in await client.responses.create(model="m", input="1+2=", stream=True, extra_headers=head)
        ]
        await http.post("/rl/sessions/streamed/end")
        await http.post("/rl/sessions/streamed/reward", json={"reward": 1.0})
        return chunks, message, events

    (chunks, message, events), ready = serve(tiny_dir, work)
    response = events[-1].response  # response.completed, or response.incomplete at the token budget
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-2].choices[0].finish_reason in ("stop", "length") and chunks[-1].usage.completion_tokens >= 1
    assert isinstance(message, anthropic.types.Message) and message.stop_reason in ("end_turn", "max_tokens")
    assert events[-1].type == f"response.{response.status}" and response.status in ("completed", "incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    (session,) = ready
    generated = chunks[-1].usage.completion_tokens + message.usage.output_tokens + response.usage.output_tokens
    assert loss_count(session) == generated and isinstance(text, str)
