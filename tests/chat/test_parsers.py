"""Scripted model outputs for every tool-call format: well-formed calls parse, malformed ones become
`ToolParseError`s that keep the model's text, calls inside reasoning stay reasoning."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

import areal_agents.models
from areal_agents.chat import (
    REASONING_PARSERS,
    ParsedReply,
    ReplyParser,
    ToolCall,
    ToolParseError,
    detect_parsers,
    parse_reply,
)
from areal_agents.chat.tool_formats import DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP
from areal_agents.errors import ArealAgentsError

TEMPLATES = Path(areal_agents.models.__file__).parent / "templates"
CALL_JSON = '{"name": "add", "arguments": {"a": 1}}'
UNICODE = {"city": "Zürich 東京 🌧", "note": 'quote " and \\ and \n newline'}


# One writer per format: each takes (name, arguments JSON text) pairs and writes them as that model would.
def hermes(*calls: tuple[str, str]) -> str:
    return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls)


def mistral(*calls: tuple[str, str]) -> str:
    items = [f'{{"name": "{n}", "arguments": {a}, "id": "id{i:07d}"}}' for i, (n, a) in enumerate(calls)]
    return "[TOOL_CALLS][" + ", ".join(items) + "]"


def granite(*calls: tuple[str, str]) -> str:
    return "<|tool_call|>[" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + "]"


def deepseek(*calls: tuple[str, str]) -> str:
    blocks = [f"{DS_CALL_BEGIN}function{DS_SEP}{n}\n```json\n{a}\n```{DS_CALL_END}" for n, a in calls]
    return DS_CALLS_BEGIN + "\n".join(blocks) + DS_CALLS_END


def harmony(*calls: tuple[str, str]) -> str:
    """Calls after an analysis message; the final ``<|call|>`` is the stop token, so it is not in the text."""
    msgs = [
        f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{a}" for n, a in calls
    ]
    return "<|channel|>analysis<|message|>Let me use the tools.<|end|>" + "<|call|>".join(msgs)


WRITERS = {"hermes": hermes, "mistral": mistral, "granite": granite, "deepseek": deepseek, "harmony": harmony}
REASONING = {"hermes": "think", "mistral": "none", "granite": "think", "deepseek": "think", "harmony": "harmony"}
FORMATS = list(WRITERS)


def parse(fmt: str, text: str) -> ParsedReply:
    return parse_reply(text, fmt, REASONING[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_call(fmt):
    reply = parse(fmt, WRITERS[fmt](("add", '{"a": 1, "b": 2}')))
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("add", {"a": 1, "b": 2})]
    assert reply.errors == [] and reply.content == ""
    assert re.fullmatch(r"[A-Za-z0-9]{9}", reply.tool_calls[0].id)


@pytest.mark.parametrize("fmt", FORMATS)
def test_several_calls_in_order(fmt):
    reply = parse(fmt, WRITERS[fmt](("add", '{"a": 1}'), ("mul", '{"x": [1, {"y": null}]}'), ("now", "{}")))
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [
        ("add", {"a": 1}),
        ("mul", {"x": [1, {"y": None}]}),
        ("now", {}),
    ]
    assert reply.errors == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_unicode_arguments(fmt):
    reply = parse(fmt, WRITERS[fmt](("weather", json.dumps(UNICODE, ensure_ascii=False))))
    assert reply.tool_calls[0].arguments == UNICODE
    assert json.loads(reply.tool_calls[0].to_openai()["function"]["arguments"]) == UNICODE


@pytest.mark.parametrize("fmt", FORMATS)
def test_arguments_as_a_json_string_are_decoded(fmt):
    reply = parse(fmt, WRITERS[fmt](("add", json.dumps(json.dumps({"a": 1})))))
    assert reply.tool_calls[0].arguments == {"a": 1} and reply.errors == []


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ('{"a": 1,}', "not valid JSON"),
        ("[1, 2]", "must be a JSON object, got a list"),
        ('"not json"', "a string that is not valid JSON"),
    ],
)
def test_bad_arguments_become_errors_with_the_call_text(fmt, arguments, message):
    """The good call next to the bad one still runs; the bad one is reported, never dropped."""
    text = WRITERS[fmt](("good", "{}"), ("bad", arguments))
    reply = parse(fmt, text)
    assert [c.name for c in reply.tool_calls] == ["good"]
    [error] = reply.errors
    assert message in error.message and str(error) == f"error: {error.message}"
    assert error.raw in text and arguments in error.raw
    assert "bad" not in reply.content and arguments not in reply.content


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"name": 7, "arguments": {"a": 1}}\n</tool_call>'),
        ("mistral", '[TOOL_CALLS][{"arguments": {"a": 1}}]'),
        ("granite", '<|tool_call|>[{"name": "", "arguments": {"a": 1}}]'),
        (
            "deepseek",
            f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}\n```json\n{{"a": 1}}\n```{DS_CALL_END}{DS_CALLS_END}',
        ),
        ("deepseek", f'{DS_CALL_BEGIN}function\n```json\n{{"a": 1}}\n```{DS_CALL_END}'),
        ("harmony", '<|channel|>commentary to=functions. <|constrain|>json<|message|>{"a": 1}'),
    ],
)
def test_a_call_without_a_name_is_an_error(fmt, text):
    reply = parse(fmt, text)
    assert reply.tool_calls == [] and reply.content == ""
    [error] = reply.errors
    assert "name" in error.message and '{"a": 1}' in error.raw


HARMONY_CUT = "<|start|>assistant to=functions.add<|channel|>commentary json"
DS_CUT = f'{DS_CALL_BEGIN}function{DS_SEP}add\n```json\n{{"a": 1}}'
UNCLOSED = [  # (format, text, the error's raw text, its message)
    ("hermes", "Sure.\n<tool_call>\n" + CALL_JSON, "<tool_call>\n" + CALL_JSON, "not closed with </tool_call>"),
    ("mistral", f"[TOOL_CALLS][{CALL_JSON}", f"[TOOL_CALLS][{CALL_JSON}", "must be followed by a JSON list"),
    ("mistral", f"[TOOL_CALLS]{CALL_JSON}", f"[TOOL_CALLS]{CALL_JSON}", "no JSON list follows it"),
    ("mistral", "[TOOL_CALLS][]", "[TOOL_CALLS][]", "empty list"),
    ("granite", f"<|tool_call|>[{CALL_JSON}", f"<|tool_call|>[{CALL_JSON}", "must be followed by a JSON list"),
    ("deepseek", DS_CALLS_BEGIN + DS_CUT, DS_CUT, "not closed"),
    ("harmony", "<|channel|>analysis<|message|>hm<|end|>" + HARMONY_CUT, HARMONY_CUT, "cut off before <|message|>"),
]


@pytest.mark.parametrize(("fmt", "text", "raw", "message"), UNCLOSED)
def test_unclosed_calls_are_errors_holding_the_rest_of_the_text(fmt, text, raw, message):
    reply = parse(fmt, text)
    assert reply.tool_calls == []
    [error] = reply.errors
    assert (error.raw, message in error.message) == (raw, True)
    assert reply.content == ("Sure." if fmt == "hermes" else "")


def test_an_unclosed_hermes_call_does_not_swallow_the_next_one():
    text = '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    reply = parse_reply(text, "hermes", "none")
    assert [c.name for c in reply.tool_calls] == ["b"]
    assert [e.raw for e in reply.errors] == ['<tool_call>{"name": "a", "arguments": {}}']


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "granite", "deepseek"])
def test_a_call_inside_the_reasoning_is_not_a_call(fmt):
    text = "<think>I could call " + WRITERS[fmt](("add", '{"a": 1}')) + " but no.</think>\n\nIt is 2."
    reply = parse_reply(text, fmt, "think")
    assert reply.tool_calls == [] and reply.errors == []
    assert reply.content == "It is 2." and '"a": 1' in reply.reasoning


def test_a_call_inside_harmony_analysis_is_not_a_call():
    text = (
        '<|channel|>analysis<|message|>Maybe to=functions.add {"a": 1}, or <tool_call>{}</tool_call>.<|end|>'
        "<|start|>assistant<|channel|>final<|message|>It is 2."
    )
    reply = parse_reply(text, "harmony", "harmony")
    assert reply.tool_calls == [] and reply.errors == []
    assert reply.content == "It is 2." and reply.reasoning.startswith("Maybe to=functions.add")


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_call_keeps_the_content(fmt):
    reply = parse_reply("The answer is 4.", fmt, "none")
    assert (reply.content, reply.tool_calls, reply.errors, reply.reasoning) == ("The answer is 4.", [], [], None)


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "granite", "deepseek"])
def test_content_around_calls_is_kept(fmt):
    text = "Let me add.\n" + WRITERS[fmt](("add", '{"a": 1}')) + "\nThen done."
    reply = parse_reply(text, fmt, "none")
    assert reply.content == "Let me add.\n\nThen done." and len(reply.tool_calls) == 1


def test_mistral_keeps_its_ids_and_makes_one_when_absent_or_malformed():
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}, "id": "abcDEF123"}, {"name": "b", "arguments": {}}, ' \
        '{"name": "c", "arguments": {}, "id": "short"}]'  # fmt: skip
    a, b, c = parse_reply(text, "mistral", "none").tool_calls
    assert a.id == "abcDEF123"
    assert re.fullmatch(r"[A-Za-z0-9]{9}", b.id) and re.fullmatch(r"[A-Za-z0-9]{9}", c.id) and b.id != c.id


def test_harmony_final_channel_and_plain_text():
    text = "<|channel|>analysis<|message|>2+2=4<|end|><|start|>assistant<|channel|>final<|message|>4"
    reply = parse_reply(text, "harmony", "harmony")
    assert (reply.reasoning, reply.content) == ("2+2=4", "4")
    reply = parse_reply("just text", "harmony", "harmony")
    assert (reply.reasoning, reply.content) == (None, "just text")


def test_harmony_recipient_before_or_after_the_channel():
    """The template writes ``assistant to=functions.X<|channel|>commentary json``; models also write the
    recipient after the channel, with ``<|constrain|>json``."""
    before = ' to=functions.add<|channel|>commentary json<|message|>{"a": 1}'
    after = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}'
    for text in (before, after):
        [call] = parse_reply(text, "harmony", "harmony").tool_calls
        assert (call.name, call.arguments) == ("add", {"a": 1})


def test_think_parser_cases():
    cases = {
        "<think>\nplan\n</think>\n\nanswer": ("plan", "answer"),
        "plan</think>answer": ("plan", "answer"),  # <think> was in the generation prompt (R1, QwQ)
        "<think>cut off by the length lim": ("cut off by the length lim", ""),
        "no reasoning": (None, "no reasoning"),
        "<think></think>answer": ("", "answer"),
        "<think>hm</think><response>The answer.</response>": ("hm", "The answer."),  # Granite 3.3 thinking
    }
    for text, expected in cases.items():
        reply = parse_reply(text, "none", "think")
        assert (reply.reasoning, reply.content) == expected, text


def test_message_and_openai_shapes():
    reply = parse_reply('<think>r</think>c<tool_call>{"name": "f", "arguments": {"x": "é"}}</tool_call>')
    call = reply.tool_calls[0]
    assert reply.message() == {
        "role": "assistant",
        "content": "c",
        "reasoning_content": "r",
        "tool_calls": [{"id": call.id, "type": "function", "function": {"name": "f", "arguments": {"x": "é"}}}],
    }
    assert call.to_openai() == {"id": call.id, "type": "function", "function": {"name": "f", "arguments": '{"x": "é"}'}}
    assert parse_reply("hi", "hermes", "none").message() == {"role": "assistant", "content": "hi"}
    assert str(ToolParseError("x", "bad")) == "error: bad" and ToolCall("f", {}).id != ToolCall("f", {}).id


EXPECTED = {
    "qwen3": ("hermes", "think"),
    "qwq": ("hermes", "think"),
    "deepseek-r1": ("deepseek", "think"),
    "mistral": ("mistral", "none"),
    "gpt-oss": ("harmony", "harmony"),
    "granite": ("granite", "think"),
}


@pytest.mark.parametrize("family", EXPECTED)
def test_detection_on_the_upstream_templates(family):
    template = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    assert detect_parsers(template) == EXPECTED[family]
    assert ReplyParser.for_template(template) == ReplyParser(*EXPECTED[family])


def test_detection_defaults_and_overrides():
    from areal_agents.models.tiny import CHAT_TEMPLATE

    assert detect_parsers(None) == detect_parsers(CHAT_TEMPLATE) == ("hermes", "none")
    assert ReplyParser.for_template(None, "mistral", "think") == ReplyParser("mistral", "think")
    assert ReplyParser.for_template("<|channel|>", reasoning_parser="none") == ReplyParser("harmony", "none")


def test_unknown_parser_names_are_refused_with_the_field_named():
    with pytest.raises(ArealAgentsError, match=r"tool_parser 'hermez'.*Did you mean 'hermes'"):
        ReplyParser.for_template(None, tool_parser="hermez")
    with pytest.raises(ArealAgentsError, match=r"reasoning_parser 'thinking'.*think, harmony, none"):
        parse_reply("x", "hermes", "thinking")


PIECES = [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|tool_call|>", DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN,
    DS_CALL_END, DS_SEP, "<|start|>", "assistant", " to=functions.f", " to=", "<|channel|>", "analysis", "final",
    "commentary", "<|constrain|>json", "<|message|>", "<|end|>", "<|call|>", "<think>", "</think>", "<response>",
    '{"name": "f", "arguments": {"a": [1, "é"]}}', '{"a": 1}', "[", "]", "{", "}", ",", '"', "\n", "```json\n", "x",
]  # fmt: skip


def test_no_parser_raises_on_garbage_and_every_error_keeps_text_from_the_reply():
    """Random runs of every format's markup and JSON fragments: parsing never raises and each error's raw
    text is the model's own."""
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 14)))
        for tool in ("hermes", "mistral", "deepseek", "harmony", "granite", "none"):
            for reasoning in ("think", "harmony", "none"):
                reply = parse_reply(text, tool, reasoning)
                rest = REASONING_PARSERS[reasoning](text).rest  # calls are looked for in what reasoning leaves
                assert all(e.raw and e.raw in rest for e in reply.errors), (text, tool, reasoning)
                assert all(isinstance(c.arguments, dict) and c.name for c in reply.tool_calls)
