import hashlib
import json
import random

import pytest
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from areal_agents.errors import ArealAgentsError
from areal_agents.models import (
    FAMILIES,
    build_family_tokenizer,
    build_tiny_tokenizer,
    family_of,
    save_tiny_model,
    stop_token_ids,
)
from areal_agents.models.families import TEMPLATES_DIR, _bpe_json

NAMES = list(FAMILIES)
SMALL = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32}
# sha256 of the vendored files: the templates must stay upstream's, unchanged (templates/SOURCES.md).
SHA256 = {
    "qwen3": "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
    "qwq": "16488ad69d85833e5f66c50174f39834b688343337e9337f018deaa21b354117",
    "deepseek-r1": "03cb8191637dd031cf7dca8bffd267b741d0cb46ab490dc7e452f62f02184b02",
    "mistral": "e4676cb56dffea7782fd3e2b577cfaf1e123537e6ef49b3ec7caa6c095c62272",
    "gpt-oss": "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146",
    "granite": "3c71df5f659987462c882bf9e295b597dc19902467a7312ea382c5896681bc02",
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 2+2"}},
                "required": ["expression"],
            },
        },
    }
]
# What each template writes for the generation prompt after a tool result, and after the final answer "42".
GEN_AFTER_TOOL = {
    "qwen3": "<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "qwq": "<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n",
    # DeepSeek: no generation prompt after tool outputs, the answer follows directly; Mistral: none at all
    "deepseek-r1": "<｜tool▁output▁begin｜>42<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
    "mistral": '[TOOL_RESULTS]{"content": 42, "call_id": "call00001"}[/TOOL_RESULTS]',
    "gpt-oss": '<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>"42"<|end|>'
    "<|start|>assistant",
    "granite": "<|start_of_role|>tool<|end_of_role|>42<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>",
}
FINAL_TURN = {
    "qwen3": "<|im_start|>assistant\n<think>\n\n</think>\n\n42<|im_end|>\n",
    "qwq": "<|im_start|>assistant\n42<|im_end|>\n",
    "deepseek-r1": "<｜tool▁outputs▁end｜>42<｜end▁of▁sentence｜>",
    "mistral": "[/TOOL_RESULTS]42</s>",
    "gpt-oss": "<|start|>assistant<|channel|>final<|message|>42<|return|>",
    "granite": "<|start_of_role|>assistant<|end_of_role|>42<|end_of_text|>\n",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family's tiny model saved as a checkpoint directory."""
    root = tmp_path_factory.mktemp("families")
    return {name: save_tiny_model(root / name, family=name, **SMALL) for name in NAMES}


def tool_conversation(name: str) -> list[dict]:
    """system, user, an assistant tool call, its result, the answer: in the shape each template reads.

    DeepSeek's template concatenates ``arguments`` (a JSON string); the others ``tojson`` them (a dict);
    Mistral wants 9-character call ids; Granite ignores ``tool_calls`` (the call is in the content).
    """
    args = {"expression": "6*7"}
    call = {"name": "calculator", "arguments": json.dumps(args) if name == "deepseek-r1" else args}
    calling = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call00001", "type": "function", "function": call}],
    }
    if name == "granite":
        calling = {
            "role": "assistant",
            "content": '<|tool_call|>[{"name": "calculator", "arguments": {"expression": "6*7"}}]',
        }
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "6*7?"},
        calling,
        {"role": "tool", "tool_call_id": "call00001", "content": "42"},
        {"role": "assistant", "content": "42"},
    ]  # fmt: skip


def test_vendored_templates_are_upstreams_unchanged():
    for name, family in FAMILIES.items():
        data = (TEMPLATES_DIR / family.template_file).read_bytes()
        assert hashlib.sha256(data).hexdigest() == SHA256[name], name
        assert family.chat_template == data.decode("utf-8")
    assert all(f.template_file in (TEMPLATES_DIR / "SOURCES.md").read_text() for f in FAMILIES.values())


@pytest.mark.parametrize("name", NAMES)
def test_saved_tokenizer_reloads_identically(saved, name):
    built = build_family_tokenizer(name)
    loaded = AutoTokenizer.from_pretrained(saved[name])
    family = FAMILIES[name]
    text = "Natalia sold 48/2 = 24 clips.\n\n  <think>x</think> 世界 🎉 " + "".join(family.special_tokens)
    assert loaded.encode(text) == built.encode(text)
    assert loaded.chat_template == built.chat_template == family.chat_template
    assert loaded.all_special_tokens == built.all_special_tokens
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == (
        family.bos_token,
        family.eos_token,
        family.pad_token,
    )
    assert AutoConfig.from_pretrained(saved[name]).vocab_size == len(loaded) == len(built)
    stops = [loaded.convert_tokens_to_ids(t) for t in family.stop_tokens]
    eos = GenerationConfig.from_pretrained(saved[name]).eos_token_id
    assert eos == (stops[0] if len(stops) == 1 else stops)


@pytest.mark.parametrize("name", NAMES)
def test_special_and_added_tokens_are_single_ids(name):
    tok, family = build_family_tokenizer(name), FAMILIES[name]
    for t in (*family.special_tokens, *family.added_tokens):
        ids = tok.encode(t, add_special_tokens=False)
        assert ids == [tok.convert_tokens_to_ids(t)] and ids[0] >= 256, t
    both = "a" + "".join(family.special_tokens) + "".join(family.added_tokens) + "b"
    # skip_special_tokens drops the special ones and keeps the added ones (Qwen's <think>, DeepSeek's tool tokens)
    assert tok.decode(tok.encode(both, add_special_tokens=False), skip_special_tokens=True) == (
        "a" + "".join(family.added_tokens) + "b"
    )


@pytest.mark.parametrize("name", NAMES)
def test_bos_is_prepended_only_where_the_real_tokenizer_does(name):
    tok, family = build_family_tokenizer(name), FAMILIES[name]
    plain = tok.encode("hi", add_special_tokens=False)
    assert tok.encode("hi") == ([tok.bos_token_id] if family.add_bos else []) + plain
    msgs = [{"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert ids == tok.encode(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    if family.add_bos:  # the template writes bos once; encoding the rendered text adds none
        assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id


@pytest.mark.parametrize("name", NAMES)
def test_template_renders_a_tool_round_trip(name):
    tok, msgs = build_family_tokenizer(name), tool_conversation(name)
    prompt = tok.apply_chat_template(msgs[:4], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith(GEN_AFTER_TOOL[name]) and "calculator" in prompt and "6*7" in prompt
    # Mistral Nemo writes the system prompt into the last message only when that is a user's: not after a tool
    assert ("Be brief." in prompt) == (name != "mistral")
    full = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    assert full.endswith(FINAL_TURN[name])
    ids = tok.apply_chat_template(msgs, tools=TOOLS, return_dict=False)
    assert tok.decode(ids) == full


def test_template_kwargs_reach_the_template():
    tok = build_family_tokenizer("qwen3")
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "1+1?"}]
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n") and off == on + "<think>\n\n</think>\n\n"
    harmony = build_family_tokenizer("gpt-oss")
    low = harmony.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, reasoning_effort="low")
    assert "Reasoning: low" in low and "Current date: " in low  # strftime_now renders


def test_raise_exception_reaches_the_caller():
    tok = build_family_tokenizer("mistral")
    with pytest.raises(Exception, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], tokenize=False)


@pytest.mark.parametrize("name", NAMES)
def test_family_of_and_stop_token_ids(name):
    tok = build_family_tokenizer(name)
    assert family_of(tok) is FAMILIES[name]
    assert stop_token_ids(tok) == [tok.convert_tokens_to_ids(t) for t in FAMILIES[name].stop_tokens]


def test_char_tokenizer_has_no_family_and_stops_at_eos():
    tok = build_tiny_tokenizer()
    assert family_of(tok) is None
    assert stop_token_ids(tok) == [tok.eos_token_id]
    assert stop_token_ids(build_family_tokenizer("gpt-oss"))[:2] == build_family_tokenizer(
        "gpt-oss"
    ).convert_tokens_to_ids(["<|return|>", "<|call|>"])


def _random_text(rng: random.Random) -> str:
    pools = ["abc XYZ 123", "世界你好日本語한국어", "🎉👍🏽🇫🇷‍", " \t\n\r\u00a0\u3000", "éñüß\u0301\u0308", '{}[]":,<|>']
    parts = []
    for _ in range(rng.randrange(1, 12)):
        if rng.random() < 0.2:  # any code point but the surrogates, which no UTF-8 string holds
            parts.append(chr(rng.choice([rng.randrange(0xD800), rng.randrange(0xE000, 0x110000)])))
        else:
            pool = rng.choice(pools)
            parts.append("".join(rng.choice(pool) for _ in range(rng.randrange(1, 6))))
    return "".join(parts)


def test_any_unicode_string_round_trips():
    rng = random.Random(0)
    toks = {name: build_family_tokenizer(name) for name in NAMES}
    for i in range(300):
        text = _random_text(rng)
        tok = toks[NAMES[i % len(NAMES)]]
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text, repr(text)


def test_training_is_deterministic_and_bpe_sized():
    assert _bpe_json.__wrapped__() == _bpe_json()
    assert len(json.loads(_bpe_json())["model"]["merges"]) > 3000


def test_unknown_family_names_the_choices(tmp_path):
    with pytest.raises(
        ArealAgentsError, match=r"family: expects one of char, qwen3, qwq, .*got 'qwen'\. Did you mean 'qwen3'\?"
    ):
        save_tiny_model(tmp_path / "m", family="qwen", **SMALL)
    with pytest.raises(
        ArealAgentsError, match=r"family: expects one of qwen3, .*got 'mistrl'\. Did you mean 'mistral'\?"
    ):
        build_family_tokenizer("mistrl")
    assert not (tmp_path / "m").exists()


def test_cli_tiny_model_family(tmp_path, capsys):
    from areal_agents.cli import TINY_FAMILIES, build_parser, main

    assert TINY_FAMILIES == tuple(FAMILIES)
    tiny = build_parser()._subparsers._group_actions[0].choices["tiny-model"]
    (family_help,) = [a.help for a in tiny._actions if a.dest == "family"]
    assert all(name in family_help for name in FAMILIES)
    assert main(["tiny-model", str(tmp_path / "g"), "--family", "granite"]) == 0
    assert family_of(AutoTokenizer.from_pretrained(tmp_path / "g")) is FAMILIES["granite"]
    assert main(["tiny-model", str(tmp_path / "x"), "--family", "granit"]) == 2
    assert "Did you mean 'granite'?" in capsys.readouterr().err
