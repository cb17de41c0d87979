"""Models that really call tools (issue 31, item 6), for each model family: the synthetic tool-use SFT
data, rendered through each family's own template, gives every assistant turn the loss tokens the family
writes for it, and the family's parser reads the same call back."""

import pytest

from areal_agents.chat.parsers import ReplyParser
from areal_agents.data.tool_use import TOOL_SCHEMAS, add, multiply, tool_use_conversations
from areal_agents.envs.tools import tool_schema
from areal_agents.models.families import build_family_tokenizer, stop_token_ids
from areal_agents.trainers.sft import conversation_to_segments

FAMILIES = ("qwen3", "qwq", "deepseek-r1", "mistral", "gpt-oss", "granite")
# Families whose replies carry reasoning (Mistral Nemo and Granite's tool format have none).
REASONING = {"qwen3": True, "qwq": True, "deepseek-r1": True, "mistral": False, "gpt-oss": True, "granite": False}
# Segments of one SFT conversation (user, call, tool result, answer), from each template's own rules:
# Qwen3 keeps reasoning in a tool loop after the last user message; QwQ drops it from every non-final
# assistant turn and DeepSeek-R1 renders a past call turn without its `<think>` part (both: a new segment
# at the tool result); gpt-oss keeps the analysis before a call until a final answer follows (the answer
# ends the conversation); Mistral and Granite carry no reasoning.
SFT_SEGMENTS = {"qwen3": 1, "qwq": 2, "deepseek-r1": 2, "mistral": 1, "gpt-oss": 1, "granite": 1}


def loss_runs(input_ids, loss_mask):
    """The maximal runs of loss tokens, in order."""
    runs, current = [], []
    for token, m in zip(input_ids, loss_mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_tool_schemas_are_what_tool_schema_makes():
    assert TOOL_SCHEMAS == [tool_schema(add), tool_schema(multiply)]


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_turns_are_the_family_format_and_parse_back(family):
    tokenizer = build_family_tokenizer(family)
    parser = ReplyParser.for_template(tokenizer.chat_template)
    stops = stop_token_ids(tokenizer)
    for conversation in tool_use_conversations(6, seed=0, reasoning=REASONING[family]):
        segments = conversation_to_segments(conversation, tokenizer, TOOL_SCHEMAS)
        assert len(segments) == SFT_SEGMENTS[family]
        runs = [run for s in segments for run in loss_runs(s.input_ids, s.loss_mask)]
        expected = [m for m in conversation if m["role"] == "assistant"]
        assert len(runs) == len(expected) == 2  # loss on the assistant turns only, one run each
        for run, message in zip(runs, expected):
            assert run[-1] in stops and not any(t in stops for t in run[:-1])
            reply = parser.parse(tokenizer.decode(run[:-1], skip_special_tokens=False))
            assert reply.errors == []
            calls = [(c.name, c.arguments) for c in reply.tool_calls]
            assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
            if family == "mistral":  # the one format that carries the call id
                assert [c.id for c in reply.tool_calls] == [c["id"] for c in message.get("tool_calls", [])]
            assert reply.content == message["content"]
            if REASONING[family] and message.get("tool_calls"):
                assert reply.reasoning == message["reasoning_content"]
            elif not REASONING[family]:
                assert not reply.reasoning
