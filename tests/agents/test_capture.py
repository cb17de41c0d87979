"""The capturing OpenAI-style client: calls merged into one token sequence when the conversation only
grows, segments when it does not; tool results and user turns never in the loss mask."""

import asyncio
import json

import pytest
from openai.types.chat import ChatCompletion
from test_segments import THINK_DROPPING_TEMPLATE, ScriptedEngine

from areal_agents.agents.capture import ChatCapture
from areal_agents.types import SamplingParams


def loss_tokens(traj):
    return [t for t, m in zip(traj.input_ids, traj.loss_mask) if m]


def capture_for(tokenizer, texts):
    engine = ScriptedEngine(tokenizer, texts)
    return engine, ChatCapture(engine, tokenizer, SamplingParams(max_new_tokens=32), episode_id="ep")


def test_append_only_conversation_is_one_trajectory(tokenizer):
    engine, capture = capture_for(tokenizer, ["8", "7"])

    async def episode():
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4?"}]
        first = await capture.client.chat.completions.create(model="m", messages=messages, temperature=0.3)
        messages += [first.choices[0].message, {"role": "user", "content": "Sure?"}]  # the SDK object itself
        second = await capture.client.chat.completions.create(model="m", messages=messages)
        return first, second

    first, second = asyncio.run(episode())
    assert isinstance(first, ChatCompletion) and first.choices[0].message.content == "8"
    assert first.choices[0].finish_reason == "stop" and first.usage.completion_tokens == 2
    (traj,) = capture.trajectories()
    assert loss_tokens(traj) == engine.outputs[0] + engine.outputs[1]
    assert traj.metadata["stop_reasons"] == ["stop", "stop"]  # the engine's, per call
    # the second prompt extends the first call's tokens, generated ones included, exactly
    assert engine.prompts[1][: len(engine.prompts[0]) + len(engine.outputs[0])] == engine.prompts[0] + engine.outputs[0]
    assert traj.input_ids[: len(engine.prompts[1])] == engine.prompts[1]
    # what is not generated is the template's render of the other turns
    user_turn = tokenizer.decode([t for t, m in zip(traj.input_ids, traj.loss_mask) if not m])
    assert "Sure?" in user_turn and "3+4?" in user_turn and "8" not in user_turn


def test_history_rewriting_template_splits_into_segments(tokenizer):
    tokenizer.chat_template = THINK_DROPPING_TEMPLATE
    engine, capture = capture_for(tokenizer, ["<think>hmm</think>8", "<think>oh</think>7"])

    async def episode():
        messages = [{"role": "user", "content": "3+4?"}]
        first = await capture.client.chat.completions.create(model="m", messages=messages)
        messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Sure?"}]
        await capture.client.chat.completions.create(model="m", messages=messages)

    asyncio.run(episode())
    first, second = capture.trajectories()
    assert (first.metadata["segment"], second.metadata["segment"]) == (0, 1)
    assert loss_tokens(first) == engine.outputs[0] and loss_tokens(second) == engine.outputs[1]
    assert first.episode_id == second.episode_id == "ep"


def test_edited_history_starts_a_new_segment(tokenizer):
    engine, capture = capture_for(tokenizer, ["8", "7"])

    async def episode():
        await capture.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "3+4?"}])
        await capture.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+5?"}])

    asyncio.run(episode())
    assert [loss_tokens(t) for t in capture.trajectories()] == engine.outputs


def test_tool_calls_become_openai_tool_calls_and_results_are_not_trained(tokenizer):
    call = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    engine, capture = capture_for(tokenizer, [call, "7"])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    async def episode():
        messages = [{"role": "user", "content": "3+4?"}]
        first = await capture.client.chat.completions.create(model="m", messages=messages, tools=tools)
        message = first.choices[0].message
        messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "7"}]
        second = await capture.client.chat.completions.create(model="m", messages=messages, tools=tools)
        return first, second

    first, second = asyncio.run(episode())
    assert first.choices[0].finish_reason == "tool_calls"
    (tool_call,) = first.choices[0].message.tool_calls
    assert tool_call.function.name == "add" and json.loads(tool_call.function.arguments) == {"a": 3, "b": 4}
    (traj,) = capture.trajectories()
    assert loss_tokens(traj) == engine.outputs[0] + engine.outputs[1]  # the tool result "7" is prompt


def test_rewards_per_call_and_per_episode(tokenizer):
    _, capture = capture_for(tokenizer, ["8", "7"])

    async def episode():
        a = await capture.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        b = await capture.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}])
        return a.id, b.id

    a, b = asyncio.run(episode())
    capture.set_reward(0.25, a)
    capture.set_reward(0.5, b)
    assert [t.reward for t in capture.trajectories()] == [0.75, 0.75]
    assert capture.trajectories()[0].turn_rewards == [0.25, 0.5]
    capture.set_reward(1.0)  # an episode reward wins over the per-call sum
    assert capture.trajectories()[0].reward == 1.0
    with pytest.raises(KeyError, match="no call of this episode"):
        capture.set_reward(1.0, "chatcmpl-unknown")


def test_bad_calls_are_clear_errors(tokenizer):
    _, capture = capture_for(tokenizer, ["8"])
    with pytest.raises(ValueError, match="messages"):
        asyncio.run(capture.client.chat.completions.create(model="m", messages=[]))
    with pytest.raises(ValueError, match="n: "):
        asyncio.run(capture.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], n=4))
