"""The gateway's Anthropic Messages and OpenAI Responses shapes over `ChatCapture`: requests become chat kwargs,
completions become the SDKs' own types, errors name the field, and a tool round through either API stays one
trajectory whose loss tokens are exactly what the engine generated."""

import asyncio
import functools
import json
import sys
from pathlib import Path

import pytest
from anthropic.types import ErrorResponse, Message
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from areal_agents.agents.capture import ChatCapture
from areal_agents.engines.model_server.openai_shapes import OpenAIRequestError, plain_message
from areal_agents.models.families import build_family_tokenizer
from areal_agents.rollout.gateway.anthropic_api import (
    anthropic_error,
    chat_kwargs_from_messages,
    message_from_completion,
)
from areal_agents.rollout.gateway.responses_api import chat_kwargs_from_responses, response_from_completion
from areal_agents.types import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))  # tests/agents: the scripted engine
from test_segments import ScriptedEngine  # noqa: E402

# What a Qwen3 model writes: reasoning, then a hermes call; then, after the tool's result, reasoning and an answer.
CALL = '<think>\nI should add.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
ANSWER = "<think>\nThe tool says 7.\n</think>\n\nIt is 7."
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
CHAT_TOOL = {"type": "function", "function": {"name": "add", "parameters": SCHEMA, "description": "a + b"}}


@functools.cache
def qwen3():
    return build_family_tokenizer("qwen3")


def capture_for(texts, tokenizer=None):
    engine = ScriptedEngine(tokenizer or qwen3(), texts)
    return engine, ChatCapture(engine, tokenizer or qwen3(), SamplingParams(max_new_tokens=64), episode_id="ep")


def loss_tokens(traj):
    return [t for t, m in zip(traj.input_ids, traj.loss_mask) if m]


def completion(message, finish="stop", **choice):
    return ChatCompletion.model_validate(
        {
            "id": "chatcmpl-abc",
            "object": "chat.completion",
            "created": 5,
            "model": "policy",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15},
        }
    )


def tool_call(call_id="c1", arguments='{"a": 3, "b": 4}'):
    return {"id": call_id, "type": "function", "function": {"name": "add", "arguments": arguments}}


# --- Anthropic Messages ---------------------------------------------------------------------------------------


def test_anthropic_request_becomes_chat_kwargs():
    body = {
        "model": "claude-x",
        "max_tokens": 100,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools.", "cache_control": {}}],
        "messages": [
            {"role": "user", "content": "3+4?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "add them", "signature": "s"},
                    {"type": "text", "text": "Adding."},
                    {"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 3, "b": 4}},
                    {"type": "tool_use", "id": "c2", "name": "add", "input": {"a": 1, "b": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "c1", "content": "7"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "c2",
                        "content": [{"type": "text", "text": "bad"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "Both?"},
                ],
            },
        ],
        "tools": [{"name": "add", "description": "a + b", "input_schema": SCHEMA}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"],
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "temperature": 0.2,
        "top_k": 5,
        "metadata": {"user_id": "u"},
    }
    kwargs = chat_kwargs_from_messages(body)
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}},
        {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 1}}},
    ]
    assert kwargs == {
        "messages": [
            {"role": "system", "content": "Be brief.\nUse tools."},
            {"role": "user", "content": "3+4?"},
            {"role": "assistant", "content": "Adding.", "reasoning_content": "add them", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "7"},
            {"role": "tool", "tool_call_id": "c2", "content": "bad"},
            {"role": "user", "content": "Both?"},
        ],
        "max_tokens": 100,
        "tools": [CHAT_TOOL],
        "tool_choice": "auto",
        "stop": ["END"],
        "chat_template_kwargs": {"enable_thinking": True},
    }
    # the capture's own normal form leaves them as they are: what it compares with the conversation it kept
    assert [plain_message(m) for m in kwargs["messages"]] == kwargs["messages"]
    off = chat_kwargs_from_messages({**body, "thinking": {"type": "disabled"}, "system": "S"})
    assert off["chat_template_kwargs"] == {"enable_thinking": False} and off["messages"][0] == {
        "role": "system",
        "content": "S",
    }


def anthropic_body(**changes):
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    return {k: v for k, v in {**body, **changes}.items() if v is not None}


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (anthropic_body(max_tokens=None), "max_tokens"),
        (anthropic_body(max_tokens=0), "max_tokens"),
        (anthropic_body(stream=True), "stream"),
        (anthropic_body(messages=[]), "messages"),
        (anthropic_body(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
        (
            anthropic_body(
                messages=[
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": [{"type": "text", "text": "see"}, IMAGE]},
                ]
            ),
            "messages[2].content[1].type",
        ),
        (
            anthropic_body(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
            "messages[0].content[0].type",
        ),
        (
            anthropic_body(
                messages=[{"role": "user", "content": [{"type": "tool_use", "id": "c", "name": "f", "input": {}}]}]
            ),
            "messages[0].content[0].type",
        ),
        (
            anthropic_body(
                messages=[
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "c", "name": "f", "input": "{}"}]}
                ]
            ),
            "messages[0].content[0].input",
        ),
        (
            anthropic_body(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "c",
                                "content": [{"type": "text", "text": "x"}, IMAGE],
                            }
                        ],
                    }
                ]
            ),
            "messages[0].content[0].content[1].type",
        ),
        (anthropic_body(system=[{"type": "image"}]), "system[0].type"),
        (anthropic_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
        (anthropic_body(tools=[{"name": "add"}]), "tools[0]"),
        (anthropic_body(tool_choice={"type": "any"}), "tool_choice"),
        (anthropic_body(tool_choice={"type": "tool", "name": "add"}), "tool_choice"),
        (anthropic_body(stop_sequences=[""]), "stop_sequences"),
        (anthropic_body(thinking={"type": "sometimes"}), "thinking.type"),
    ],
)
def test_anthropic_request_errors_name_the_field(body, param):
    with pytest.raises(OpenAIRequestError) as error:
        chat_kwargs_from_messages(body)
    assert error.value.param == param and str(error.value).startswith(f"{param}: ")


def test_message_from_completion_blocks_and_stop_reasons():
    reply = {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [tool_call()]}
    message = Message.model_validate(message_from_completion(completion(reply, "tool_calls"), None, "claude-x"))
    assert [b.type for b in message.content] == ["thinking", "tool_use"]  # no empty text beside a tool use
    assert (message.content[0].thinking, message.content[0].signature) == ("r", "")
    assert message.content[1].model_dump(exclude_none=True) == {
        "type": "tool_use",
        "id": "c1",
        "name": "add",
        "input": {"a": 3, "b": 4},
    }
    assert (message.id, message.model, message.stop_reason, message.stop_sequence) == (
        "msg_abc",
        "claude-x",
        "tool_use",
        None,
    )
    assert (message.usage.input_tokens, message.usage.output_tokens) == (11, 4)

    def stop_of(finish, **choice):
        out = message_from_completion(completion({"role": "assistant", "content": ""}, finish, **choice), ["END"], "m")
        return Message.model_validate(out), out

    truncated, _ = stop_of("length")
    assert truncated.stop_reason == "max_tokens" and [b.model_dump(exclude_none=True) for b in truncated.content] == [
        {"type": "text", "text": ""}
    ]
    assert stop_of("stop")[0].stop_reason == "end_turn"
    assert (
        stop_of("stop", stop_reason="END")[0].stop_reason,
        stop_of("stop", stop_reason="END")[1]["stop_sequence"],
    ) == ("stop_sequence", "END")
    assert stop_of("stop", stop_reason="OTHER")[0].stop_reason == "end_turn"  # not one the request asked for


def test_stop_sequence_known_from_the_capture(tokenizer):
    _, capture = capture_for(["7 END and more"], tokenizer)
    body = anthropic_body(stop_sequences=["END", "STOP"])
    reply = asyncio.run(capture.create(**chat_kwargs_from_messages(body)))
    message = Message.model_validate(message_from_completion(reply, body["stop_sequences"], "m"))
    assert (message.stop_reason, message.stop_sequence, message.content[0].text) == ("stop_sequence", "END", "7")
    eos = asyncio.run(capture_for(["7"], tokenizer)[1].create(**chat_kwargs_from_messages(body)))
    assert message_from_completion(eos, ["END"], "m")["stop_reason"] == "end_turn"


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
    ],
)
def test_anthropic_error_bodies(status, kind):
    response = anthropic_error(status, "expects an integer", "max_tokens")
    body = json.loads(response.body)
    assert response.status_code == status and ErrorResponse.model_validate(body).error.type == kind
    assert body == {"type": "error", "error": {"type": kind, "message": "max_tokens: expects an integer"}}
    named = anthropic_error(status, str(OpenAIRequestError("stream", "no")), "stream")  # already named: once
    assert json.loads(named.body)["error"]["message"] == "stream: no"


def test_anthropic_tool_round_is_one_trajectory():
    """request -> capture -> Message; the client appends the Message's content and a tool_result -> the second
    request continues the same token sequence: one trajectory, trained on exactly the two generations."""
    engine, capture = capture_for([CALL, ANSWER])
    body = {
        "model": "m",
        "max_tokens": 64,
        "system": "Be brief.",
        "tools": [{"name": "add", "description": "a + b", "input_schema": SCHEMA}],
        "messages": [{"role": "user", "content": "3+4?"}],
    }

    async def episode():
        first = Message.model_validate(
            message_from_completion(await capture.create(**chat_kwargs_from_messages(body)), None, "m")
        )
        (use,) = [b for b in first.content if b.type == "tool_use"]
        body["messages"] += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "7"}]},
        ]
        second = Message.model_validate(
            message_from_completion(await capture.create(**chat_kwargs_from_messages(body)), None, "m")
        )
        return first, use, second

    first, use, second = asyncio.run(episode())
    assert first.stop_reason == "tool_use" and (use.name, use.input) == ("add", {"a": 3, "b": 4})
    assert [b.type for b in second.content] == ["thinking", "text"] and second.content[1].text == "It is 7."
    (traj,) = capture.trajectories()
    assert loss_tokens(traj) == engine.outputs[0] + engine.outputs[1]
    assert engine.prompts[1][: len(engine.prompts[0]) + len(engine.outputs[0])] == engine.prompts[0] + engine.outputs[0]


# --- OpenAI Responses -----------------------------------------------------------------------------------------


def test_responses_request_becomes_chat_kwargs():
    body = {
        "model": "gpt-x",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "3+4?"}, {"type": "input_text", "text": "1+1?"}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "add them"}]},
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Adding.", "annotations": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "c1",
                "name": "add",
                "arguments": '{"a": 3, "b": 4}',
                "status": "completed",
            },
            {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 1, "b": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "7"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "both done"}]},
            {"type": "function_call", "call_id": "c3", "name": "add", "arguments": "{}"},
        ],
        "tools": [{"type": "function", "name": "add", "description": "a + b", "parameters": SCHEMA, "strict": True}],
        "tool_choice": "auto",
        "max_output_tokens": 50,
        "reasoning": {"effort": "low"},
        "temperature": 0.1,
        "top_p": 0.5,
        "store": False,
        "metadata": {},
        "parallel_tool_calls": True,
        "truncation": "auto",
        "user": "u",
    }
    kwargs = chat_kwargs_from_responses(body)
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}},
        {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 1}}},
    ]
    third = {"id": "c3", "type": "function", "function": {"name": "add", "arguments": {}}}
    assert kwargs == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "3+4?\n1+1?"},
            {"role": "assistant", "content": "Adding.", "reasoning_content": "add them", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "7"},
            {"role": "tool", "tool_call_id": "c2", "content": "2"},
            {"role": "assistant", "content": "", "reasoning_content": "both done", "tool_calls": [third]},
        ],
        "tools": [CHAT_TOOL],
        "tool_choice": "auto",
        "max_tokens": 50,
        "chat_template_kwargs": {"enable_thinking": True},
    }
    assert [plain_message(m) for m in kwargs["messages"]] == kwargs["messages"]
    assert chat_kwargs_from_responses({"input": "hi", "reasoning": {"effort": "none"}}) == {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False},
    }


def test_responses_reasoning_without_an_assistant_turn_is_one():
    items = [
        {"role": "user", "content": "a"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}]},
        {"role": "user", "content": "b"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "end"}]},
    ]
    assert chat_kwargs_from_responses({"input": items})["messages"] == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "", "reasoning_content": "hmm"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "", "reasoning_content": "end"},
    ]


def responses_body(**changes):
    return {k: v for k, v in {"model": "m", "input": "hi", **changes}.items() if v is not None}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (responses_body(stream=True), "stream"),
        (responses_body(previous_response_id="resp_1"), "previous_response_id"),
        (responses_body(input=[]), "input"),
        (responses_body(input=None), "input"),
        (responses_body(instructions=["x"]), "instructions"),
        (
            responses_body(
                input=[
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
                ]
            ),
            "input[1].content[0].type",
        ),
        (responses_body(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type"),
        (responses_body(input=[{"role": "tool", "content": "x"}]), "input[0].role"),
        (
            responses_body(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]),
            "input[0].arguments",
        ),
        (
            responses_body(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]),
            "input[0].arguments",
        ),
        (responses_body(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "input[0].call_id"),
        (responses_body(input=[{"type": "function_call_output", "output": "7"}]), "input[0].call_id"),
        (
            responses_body(input=[{"type": "reasoning", "summary": [{"type": "text", "text": "x"}]}]),
            "input[0].summary[0].type",
        ),
        (responses_body(tools=[{"type": "function", "name": "f"}, {"type": "web_search"}]), "tools[1].type"),
        (responses_body(tools=[{"type": "function"}]), "tools[0].name"),
        (responses_body(tool_choice="required"), "tool_choice"),
        (responses_body(tool_choice={"type": "function", "name": "f"}), "tool_choice"),
        (responses_body(max_output_tokens=0), "max_output_tokens"),
        (responses_body(reasoning={"effort": 3}), "reasoning.effort"),
    ],
)
def test_responses_request_errors_name_the_field(body, param):
    with pytest.raises(OpenAIRequestError) as error:
        chat_kwargs_from_responses(body)
    assert error.value.param == param and str(error.value).startswith(f"{param}: ")


def test_response_from_completion_items_and_status():
    reply = {
        "role": "assistant",
        "content": "Adding.",
        "reasoning_content": "r",
        "tool_calls": [tool_call(), tool_call("c2", "{}")],
    }
    response = Response.model_validate(response_from_completion(completion(reply, "tool_calls"), "gpt-x"))
    reasoning, message, call, second = response.output
    assert (response.id, response.model, response.status, response.incomplete_details) == (
        "resp_abc",
        "gpt-x",
        "completed",
        None,
    )
    assert [s.model_dump() for s in reasoning.summary] == [{"type": "summary_text", "text": "r"}]
    assert (message.type, message.status, message.content[0].text, message.content[0].annotations) == (
        "message",
        "completed",
        "Adding.",
        [],
    )
    assert (call.type, call.call_id, call.name, json.loads(call.arguments), call.status) == (
        "function_call",
        "c1",
        "add",
        {"a": 3, "b": 4},
        "completed",
    )
    assert call.id.startswith("fc_") and call.id != second.id and second.call_id == "c2"
    assert response.output_text == "Adding."
    usage = response.usage
    assert (
        usage.input_tokens,
        usage.output_tokens,
        usage.total_tokens,
        usage.output_tokens_details.reasoning_tokens,
    ) == (11, 4, 15, 0)

    calls_only = Response.model_validate(
        response_from_completion(
            completion({"role": "assistant", "content": None, "tool_calls": [tool_call()]}, "tool_calls"), "m"
        )
    )
    assert [item.type for item in calls_only.output] == ["function_call"]  # no empty message beside a call
    truncated = Response.model_validate(
        response_from_completion(completion({"role": "assistant", "content": "It is"}, "length"), "m")
    )
    assert (truncated.status, truncated.incomplete_details.reason, truncated.output[0].status) == (
        "incomplete",
        "max_output_tokens",
        "incomplete",
    )
    assert "output_text" not in response_from_completion(completion({"role": "assistant", "content": "x"}), "m")


def test_responses_tool_round_is_one_trajectory():
    """request -> capture -> Response; the client appends its output items and a function_call_output -> the
    second request continues the same token sequence: one trajectory, trained on exactly the two generations."""
    engine, capture = capture_for([CALL, ANSWER])
    tools = [{"type": "function", "name": "add", "description": "a + b", "parameters": SCHEMA, "strict": False}]
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "tools": tools,
        "input": [{"role": "user", "content": "3+4?"}],
        "store": False,
    }

    async def episode():
        first = Response.model_validate(
            response_from_completion(await capture.create(**chat_kwargs_from_responses(body)), "m")
        )
        (call,) = [item for item in first.output if item.type == "function_call"]
        body["input"] += [item.model_dump(exclude_none=True) for item in first.output]
        body["input"].append({"type": "function_call_output", "call_id": call.call_id, "output": "7"})
        second = Response.model_validate(
            response_from_completion(await capture.create(**chat_kwargs_from_responses(body)), "m")
        )
        return first, call, second

    first, call, second = asyncio.run(episode())
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 3, "b": 4})
    assert [item.type for item in second.output] == ["reasoning", "message"] and second.output_text == "It is 7."
    (traj,) = capture.trajectories()
    assert loss_tokens(traj) == engine.outputs[0] + engine.outputs[1]
    assert engine.prompts[1][: len(engine.prompts[0]) + len(engine.outputs[0])] == engine.prompts[0] + engine.outputs[0]
