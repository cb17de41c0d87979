"""The capturing OpenAI-style client: calls merged into one token sequence when the conversation only
grows, segments when it does not; tool results and user turns never in the loss mask."""

import asyncio
import json

import pytest
from openai.types.chat import ChatCompletion
from test_segments import THINK_DROPPING_TEMPLATE, ScriptedEngine

from areal_agents.agents.capture import ChatCapture
from areal_agents.chat import ReplyParser
from areal_agents.engines.model_server.openai_shapes import OpenAIRequestError
from areal_agents.models.families import build_family_tokenizer
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
    counts = {k: traj.metadata[k] for k in ("tool_calls", "tool_parse_failures", "num_segments")}
    assert counts == {"tool_calls": 1, "tool_parse_failures": 0, "num_segments": 1}  # rollout/ metrics sum them


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
    user = [{"role": "user", "content": "a"}]
    for bad, field in [({"n": 0}, "n"), ({"top_logprobs": 2}, "top_logprobs"), ({"stop": [""]}, "stop")]:
        with pytest.raises(OpenAIRequestError, match=f"^{field}: ") as info:
            asyncio.run(capture.client.chat.completions.create(model="m", messages=user, **bad))
        assert info.value.param == field
    bad_call = {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}
    with pytest.raises(OpenAIRequestError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        asyncio.run(capture.client.chat.completions.create(model="m", messages=[*user, bad_call]))


def test_n_choices_are_branches_each_trained_once(tokenizer):
    engine, capture = capture_for(tokenizer, ["8", "9", "7"])

    async def episode():
        messages = [{"role": "user", "content": "3+4?"}]
        first = await capture.client.chat.completions.create(model="m", messages=messages, n=2)
        picked = first.choices[1].message  # the agent goes on from the second choice
        messages += [picked, {"role": "user", "content": "Sure?"}]
        await capture.client.chat.completions.create(model="m", messages=messages)
        return first

    first = asyncio.run(episode())
    assert [c.message.content for c in first.choices] == ["8", "9"] and first.usage.completion_tokens == 4
    assert engine.prompts[0] == engine.prompts[1]  # both choices sampled from the same prompt
    main, branch = capture.trajectories()
    assert loss_tokens(main) == engine.outputs[0]
    # the continued branch: its own choice and the next turn, which extends it token for token
    assert loss_tokens(branch) == engine.outputs[1] + engine.outputs[2]
    assert engine.prompts[2][: len(engine.prompts[1]) + 2] == engine.prompts[1] + engine.outputs[1]
    assert main.turn_rewards == [0.0, 0.0]  # one call id for both choices, then the second call


def test_reasoning_stop_strings_and_logprobs(tokenizer):
    engine = ScriptedEngine(tokenizer, ["<think>hm</think>7 END then more"])
    parser = ReplyParser("hermes", "think")
    capture = ChatCapture(engine, tokenizer, SamplingParams(max_new_tokens=64), episode_id="ep", parser=parser)
    messages = [{"role": "user", "content": "3+4?"}]
    reply = asyncio.run(
        capture.client.chat.completions.create(model="m", messages=messages, stop=[" END"], logprobs=True)
    )
    (choice,) = reply.choices
    assert choice.message.content == "7" and choice.message.reasoning_content == "hm"
    assert choice.finish_reason == "stop"
    kept = tokenizer.encode("<think>hm</think>7 END", add_special_tokens=False)  # one token per character
    (traj,) = capture.trajectories()
    assert loss_tokens(traj) == kept and reply.usage.completion_tokens == len(kept)  # not what came after
    assert [t.token for t in choice.logprobs.content] == list("<think>hm</think>7 END")
    assert [t.logprob for t in choice.logprobs.content] == [-0.5] * len(kept)


def test_a_malformed_call_stays_in_content_and_is_not_a_tool_call(tokenizer):
    text = 'ok <tool_call>{"name": "add", "arguments": {"a": 3</tool_call>'
    _, capture = capture_for(tokenizer, [text])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "3+4?"}]
    reply = asyncio.run(capture.client.chat.completions.create(model="m", messages=messages, tools=tools))
    (choice,) = reply.choices
    assert choice.message.content == text and not choice.message.tool_calls and choice.finish_reason == "stop"
    (error,) = choice.tool_call_errors  # non-standard key: the parse error the agent may answer
    assert error.startswith("error: ") and "JSON" in error
    (traj,) = capture.trajectories()  # what rollout/tool_parse_failures sums
    assert (traj.metadata["tool_calls"], traj.metadata["tool_parse_failures"]) == (0, 1)


def test_chat_template_kwargs_per_call_on_qwen3():
    """``chat_template_kwargs`` reach Qwen3's real template (``enable_thinking: false`` opens an empty think
    block); a call that changes them renders anew, a segment of its own."""
    tokenizer = build_family_tokenizer("qwen3")
    engine, capture = capture_for(tokenizer, ["4", "5"])
    messages = [{"role": "user", "content": "2+2?"}]
    off = {"enable_thinking": False}

    async def episode():
        first = await capture.client.chat.completions.create(model="m", messages=messages, chat_template_kwargs=off)
        more = [*messages, first.choices[0].message, {"role": "user", "content": "2+3?"}]
        await capture.client.chat.completions.create(model="m", messages=more)
        return first

    first = asyncio.run(episode())
    assert first.choices[0].message.content == "4" and first.choices[0].message.model_extra == {}
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert engine.prompts[0] == tokenizer.encode(text, add_special_tokens=False)
    first_traj, second_traj = capture.trajectories()  # other kwargs: the second call is a new segment
    assert loss_tokens(first_traj) == engine.outputs[0] and loss_tokens(second_traj) == engine.outputs[1]
    assert tokenizer.decode(engine.prompts[1]).endswith("2+3?<|im_end|>\n<|im_start|>assistant\n")
