"""Property test: random well-formed calls (random names, nested unicode arguments), rendered by each
family's real chat template as the assistant turn the model would generate, parse back to the same calls.

The templates are rendered with transformers' own renderer (what `apply_chat_template` runs). Granite's
template does not render tool calls, so its turns are written in the format its system prompt teaches.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

import areal_agents.models
from areal_agents.chat import ReplyParser, ToolCall

TEMPLATES = Path(areal_agents.models.__file__).parent / "templates"
CASES = 200
# No "<": a random string must not spell a tag of any format; everything else JSON must escape is in.
ALPHABET = string.ascii_letters + string.digits + " \"\\\n\t{}[],:>|`'/éüß東京🌧"


@dataclass(frozen=True)
class Family:
    """How one family's template writes an assistant turn that makes tool calls."""

    header: str  # what the template writes before the generated text (the generation prompt's start)
    stop: str  # what it writes after it: the stop token (not in the text the parser gets), maybe a newline
    reasoning: bool  # the template renders the turn's reasoning
    content: bool  # the template renders content next to the calls
    max_calls: int = 3  # gpt-oss's template renders one call per message
    string_arguments: bool = False  # DeepSeek's template concatenates the arguments, so they must be a string
    special: tuple[tuple[str, str], ...] = ()
    no_content: str | None = ""  # a calls-only message's content: DeepSeek's template renders "" as a second turn


FAMILIES = {
    "qwen3": Family("<|im_start|>assistant\n", "<|im_end|>\n", reasoning=True, content=True),
    "qwq": Family("<|im_start|>assistant", "<|im_end|>\n", reasoning=False, content=True),
    "deepseek-r1": Family(
        "<｜Assistant｜>", "<｜end▁of▁sentence｜>", reasoning=False, content=False,
        string_arguments=True, no_content=None,
        special=(("bos_token", "<｜begin▁of▁sentence｜>"), ("eos_token", "<｜end▁of▁sentence｜>")),
    ),
    "mistral": Family(
        "", "</s>", reasoning=False, content=False, special=(("bos_token", "<s>"), ("eos_token", "</s>"))
    ),
    "gpt-oss": Family("<|start|>assistant", "<|call|>", reasoning=True, content=False, max_calls=1),
}  # fmt: skip


def rand_text(rng: random.Random, n: int = 12) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, n)))


def rand_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(["str", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 3 else []))
    if kind == "list":
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        return rand_arguments(rng, depth + 1)
    return {
        "str": lambda: rand_text(rng),
        "int": lambda: rng.randint(-(10**12), 10**12),
        "float": lambda: rng.uniform(-1e6, 1e6),
        "bool": lambda: rng.random() < 0.5,
        "null": lambda: None,
    }[kind]()


def rand_arguments(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    return {rand_text(rng, 8): rand_value(rng, depth) for _ in range(rng.randint(0, 4))}


def rand_call(rng: random.Random) -> ToolCall:
    name = rng.choice(string.ascii_letters + "_") + "".join(
        rng.choice(string.ascii_letters + string.digits + "_") for _ in range(rng.randint(0, 12))
    )
    return ToolCall(name, rand_arguments(rng))


def rand_words(rng: random.Random) -> str:
    """Reasoning or content: some text with at least one letter in it."""
    return rand_text(rng, 30) + rng.choice(string.ascii_letters) + rand_text(rng, 10)


def generated_turn(family: str, spec: Family, template: str, message: dict[str, Any]) -> str:
    """The text the model generated for ``message``: the template's rendering of it, minus header and stop."""
    user = [{"role": "user", "content": "go"}]
    kwargs = dict(spec.special)
    [before], _ = render_jinja_template([user], chat_template=template, **kwargs)
    [full], _ = render_jinja_template([user + [message]], chat_template=template, **kwargs)
    assert full.startswith(before + spec.header) and full.endswith(spec.stop), (family, full)
    return full[len(before) + len(spec.header) : len(full) - len(spec.stop)]


@pytest.mark.parametrize("family", FAMILIES)
def test_calls_rendered_by_the_real_template_parse_back(family):
    spec = FAMILIES[family]
    template = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    parser = ReplyParser.for_template(template)
    rng = random.Random(f"roundtrip-{family}")
    for _ in range(CASES):
        calls = [rand_call(rng) for _ in range(rng.randint(1, spec.max_calls))]
        entries = [c.to_message() for c in calls]
        if spec.string_arguments:
            for entry in entries:
                entry["function"]["arguments"] = json.dumps(entry["function"]["arguments"], ensure_ascii=False)
        content = rand_words(rng) if spec.content and rng.random() < 0.5 else ""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if spec.content else spec.no_content,
            "tool_calls": entries,
        }
        reasoning = rand_words(rng) if spec.reasoning and rng.random() < 0.7 else None
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        text = generated_turn(family, spec, template, message)
        reply = parser.parse(text)
        assert reply.errors == [], text
        assert [(c.name, c.arguments) for c in reply.tool_calls] == [(c.name, c.arguments) for c in calls], text
        assert reply.content == content.strip(), text
        expected_reasoning = reasoning.strip() if reasoning is not None else ("" if family == "qwen3" else None)
        assert reply.reasoning == expected_reasoning, text
        if family == "mistral":
            assert [c.id for c in reply.tool_calls] == [c.id for c in calls]


def test_granite_calls_in_the_taught_format_parse_back():
    """Granite 3.3's system prompt: "respond only with <|tool_call|> followed by a JSON list of tools used"."""
    template = (TEMPLATES / "granite.jinja").read_text(encoding="utf-8")
    parser = ReplyParser.for_template(template)
    rng = random.Random("roundtrip-granite")
    for _ in range(CASES):
        calls = [rand_call(rng) for _ in range(rng.randint(1, 3))]
        listed = [{"name": c.name, "arguments": c.arguments} for c in calls]
        indent, ascii_only = rng.choice([None, 2]), rng.random() < 0.5
        text = "<|tool_call|>" + json.dumps(listed, indent=indent, ensure_ascii=ascii_only)
        reply = parser.parse(text)
        assert reply.errors == [] and reply.content == "", text
        assert [(c.name, c.arguments) for c in reply.tool_calls] == [(c.name, c.arguments) for c in calls], text
