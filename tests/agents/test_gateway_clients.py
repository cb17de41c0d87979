"""Real clients, unchanged, through the gateway (issue 48): the `openai` SDK (chat completions and responses),
openai-agents' `Runner.run` and the `anthropic` SDK each complete a tool round trip (get_weather -> its result
-> the answer) against a tiny qwen3 model taught those replies (test_openai_frameworks), served greedily; each
session is captured token for token (the loss tokens are the taught ones) and trained once ended and rewarded,
the reward posted after the end, per session or per call by the id the client saw (``chatcmpl-``, ``resp_``,
``msg_``).

The Responses and Messages APIs carry a tool as name, description and schema only (no ``strict``; Anthropic's
keys in another order), so the template renders another tools line than the chat clients' `TOOLS`: the fixture's
model learns the same replies after those two prompts as well.
"""

import asyncio
import json

import anthropic
import httpx
import pytest
from openai import AsyncOpenAI
from test_openai_frameworks import (
    ANSWER,
    QUESTION,
    RESULT,
    SYSTEM,
    TOOLS,
    ToolModel,
    agents_round_trip,
    check_sdk_replies,
    family_conversation,
    family_trajectories,
    learn,
    loss_tokens,
    sdk_round_trip,
    train_tool_model,
)

from areal_agents.config import GatewayConfig
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.models import load_model, load_tokenizer
from areal_agents.rollout.gateway.anthropic_api import chat_kwargs_from_messages
from areal_agents.rollout.gateway.responses_api import chat_kwargs_from_responses
from areal_agents.rollout.gateway.server import Gateway
from areal_agents.trainers.sft import conversation_to_segments
from areal_agents.types import SamplingParams

pytestmark = [pytest.mark.process, pytest.mark.slow]  # trains the tool model twice: about 30 s

FUNCTION = TOOLS[0]["function"]
RESPONSES_TOOLS = [{"type": "function", **FUNCTION}]  # strict included: the gateway drops it
ANTHROPIC_TOOLS = [
    {"name": FUNCTION["name"], "description": FUNCTION["description"], "input_schema": FUNCTION["parameters"]}
]
USER = {"role": "user", "content": QUESTION}


def gateway_tools() -> list[list[dict]]:
    """The chat tools the gateway renders for a Responses and for a Messages client's tool."""
    messages = [USER]
    return [
        chat_kwargs_from_responses({"input": messages, "tools": RESPONSES_TOOLS})["tools"],
        chat_kwargs_from_messages({"max_tokens": 1, "messages": messages, "tools": ANTHROPIC_TOOLS})["tools"],
    ]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> ToolModel:
    """The qwen3 tool model, taught the replies after the Responses and Messages tools' prompts too."""
    trained = train_tool_model(tmp_path_factory.mktemp("gateway_tool_model"), "qwen3")
    assert all(tools != TOOLS for tools in gateway_tools())  # else the extra prompts are not needed
    tokenizer, model = load_tokenizer(trained.path), load_model(trained.path)
    conversation = family_conversation("qwen3")
    extra = [t for tools in gateway_tools() for t in conversation_to_segments(conversation, tokenizer, tools=tools)]
    learn(model, tokenizer, family_trajectories("qwen3", tokenizer) + extra, "qwen3 (gateway tools)")
    model.save_pretrained(trained.path)
    return trained


def serve(tool_model: ToolModel, work):
    """Run ``work(gateway, http)`` against a started gateway on the tool model, greedy; return its result and
    the sessions handed to training."""
    ready = []

    async def main():
        engine = HFEngine(load_model(tool_model.path), max_batch_size=4, num_threads=1)
        sampling = SamplingParams(max_new_tokens=96, temperature=0)  # the gateway samples, not the client
        gateway = Gateway(GatewayConfig(port=0), engine, load_tokenizer(tool_model.path), sampling, ready.append)
        await gateway.start()
        try:
            async with httpx.AsyncClient(base_url=gateway.url) as http:
                return await work(gateway, http)
        finally:
            await gateway.stop()
            await engine.aclose()

    return asyncio.run(main()), ready


async def end_then_reward(http: httpx.AsyncClient, sid: str, rewards: dict[str | None, float]) -> list[dict]:
    """End session ``sid``, then post each reward (a key: the call's id, None: the session's); the replies."""
    replies = [(await http.post(f"/rl/sessions/{sid}/end")).json()]
    for call, reward in rewards.items():
        body = {"reward": reward} | ({"completion_id": call} if call else {})
        reply = await http.post(f"/rl/sessions/{sid}/reward", json=body)
        assert reply.status_code == 200, reply.text
        replies.append(reply.json())
    return replies


def check_captured(tool_model: ToolModel, ready: list, reward: float, turn_rewards: list[float]) -> None:
    """One session trained: the loss tokens are the taught replies, as sampled; its rewards as posted."""
    (session,) = ready
    assert [loss_tokens(t) for t in session.trajectories] == tool_model.segments
    assert all(t.metadata["num_turns"] == 2 for t in session.trajectories)
    assert session.reward == reward and session.trajectories[0].reward == reward
    assert all(t.turn_rewards == turn_rewards for t in session.trajectories)


def test_openai_sdk_tool_round_trip_with_a_reward_after_the_end(tool_model):
    async def work(gateway, http):
        client = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="none", default_headers={"X-Session-Id": "sdk-1"})
        async with client:
            replies = await sdk_round_trip(client)
        ended, rewarded = await end_then_reward(http, "sdk-1", {None: 0.75})
        return replies, ended, rewarded

    ((first, second), ended, rewarded), ready = serve(tool_model, work)
    check_sdk_replies(tool_model, first, second)
    assert ended["ended"] and ended["calls"] == 2 and ended["reward"] is None and rewarded["reward"] == 0.75
    check_captured(tool_model, ready, 0.75, [0.0, 0.0])


def test_openai_agents_runner_through_a_session_base_url(tool_model):
    async def work(gateway, http):
        opened = (await http.post("/rl/sessions", json={"task": "weather"})).json()
        final, calls = await agents_round_trip(opened["openai_base_url"])
        await end_then_reward(http, opened["session_id"], {None: 1.0})
        return final, calls

    (final, calls), ready = serve(tool_model, work)
    assert calls == ["Paris"] and final == ANSWER
    check_captured(tool_model, ready, 1.0, [0.0, 0.0])
    assert ready[0].task == "weather" and ready[0].trajectories[0].group_id == "task:weather"


def test_responses_tool_round_trip_with_per_call_rewards(tool_model):
    async def work(gateway, http):
        opened = (await http.post("/rl/sessions", json={})).json()
        async with AsyncOpenAI(base_url=opened["openai_base_url"], api_key="none") as client:
            ask = lambda given: client.responses.create(  # noqa: E731
                model="policy", instructions=SYSTEM, input=given, tools=RESPONSES_TOOLS, max_output_tokens=96
            )
            first = await ask([USER])
            (call,) = [item for item in first.output if item.type == "function_call"]
            output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
            second = await ask([USER, *first.output, output])
        await end_then_reward(http, opened["session_id"], {first.id: 0.25, second.id: 0.5})
        return first, call, second

    (first, call, second), ready = serve(tool_model, work)
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert first.output[0].summary[0].text == tool_model.reasoning[0]
    assert second.output_text == ANSWER and second.status == "completed"
    check_captured(tool_model, ready, 0.75, [0.25, 0.5])


def test_anthropic_tool_round_trip_with_per_call_rewards_by_message_id(tool_model):
    async def work(gateway, http):
        opened = (await http.post("/rl/sessions", json={})).json()
        async with anthropic.AsyncAnthropic(base_url=opened["anthropic_base_url"], api_key="none") as client:
            ask = lambda messages: client.messages.create(  # noqa: E731
                model="policy", max_tokens=96, system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS
            )
            first = await ask([USER])
            (use,) = [block for block in first.content if block.type == "tool_use"]
            result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}
            second = await ask([USER, {"role": "assistant", "content": first.content}, result])
        ended, *_ = await end_then_reward(http, opened["session_id"], {first.id: 1.0, second.id: 0.5})
        return first, use, second, ended

    (first, use, second, ended), ready = serve(tool_model, work)
    assert [block.type for block in first.content] == ["thinking", "tool_use"]
    assert first.content[0].thinking == tool_model.reasoning[0] and first.stop_reason == "tool_use"
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    assert [block.type for block in second.content] == ["thinking", "text"]
    assert second.content[1].text == ANSWER and second.stop_reason == "end_turn"
    assert ended["ended"] and ended["call_rewards"] == {}  # no reward yet: not handed on at its end
    check_captured(tool_model, ready, 1.5, [1.0, 0.5])
