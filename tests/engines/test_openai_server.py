"""serve-model's OpenAI-compatible routes on the tiny model: the SDK's own types parse every reply; n, stop
strings, logprobs, usage and chat_template_kwargs (Qwen3's ``enable_thinking`` on a qwen3-family model) do what
OpenAI's API says; bad requests are 400s in OpenAI's error shape naming the field; a bad --tool-parser or
--reasoning-parser stops serve-model at startup. (The tool-calling round trip with trained models: tests/agents/
test_openai_frameworks.py.)"""

import pytest
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion

from areal_agents.chat import ReplyParser
from areal_agents.chat.template_messages import template_message
from areal_agents.cli import main
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.model_server import ModelServer, ModelServerConfig, build_app
from areal_agents.engines.model_server.openai_routes import chat_parser
from areal_agents.errors import ArealAgentsError
from areal_agents.models import load_model, load_tokenizer, save_tiny_model

USER = [{"role": "user", "content": "3+4?"}]


@pytest.fixture(scope="module")
def client(tiny_dir):
    tokenizer = load_tokenizer(tiny_dir)
    engine = HFEngine(load_model(tiny_dir), max_batch_size=8)
    with TestClient(build_app(engine, tokenizer, ModelServerConfig(model_path=str(tiny_dir)))) as c:
        c.tokenizer = tokenizer
        yield c


def chat(client, **body):
    reply = client.post("/v1/chat/completions", json={"model": "m", "messages": USER, **body})
    assert reply.status_code == 200, reply.text
    return ChatCompletion.model_validate(reply.json())


def test_chat_completion_n_logprobs_and_usage(client):
    reply = chat(client, n=3, max_tokens=6, logprobs=True, temperature=0)
    prompt = client.tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert reply.object == "chat.completion" and len(reply.choices) == 3
    assert reply.usage.prompt_tokens == len(client.tokenizer.encode(prompt, add_special_tokens=False))
    texts = {c.message.content for c in reply.choices}
    assert len(texts) == 1  # greedy: the same text three times
    for i, c in enumerate(reply.choices):
        assert c.index == i and c.message.role == "assistant"
        tokens = c.logprobs.content
        assert 1 <= len(tokens) <= 6 and all(t.logprob <= 0 and t.top_logprobs == [] for t in tokens)
        assert all(bytes(t.bytes).decode() == t.token for t in tokens)
        assert c.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)


def test_stop_string_cuts_the_reply_and_its_tokens(client):
    full = chat(client, max_tokens=12, temperature=0, logprobs=True).choices[0]
    tokens = [t.token for t in full.logprobs.content]
    assert full.finish_reason == "length" and len(tokens) == 12  # the untrained model writes 12 characters
    stop = "".join(tokens[2:4])
    cut = chat(client, max_tokens=12, temperature=0, logprobs=True, stop=["never there", stop]).choices[0]
    at = "".join(tokens).index(stop)
    assert cut.finish_reason == "stop" and cut.message.content == "".join(tokens[:at]).strip()
    # the tokens up to the stop string are the reply's; what the engine sampled after it is not
    assert [t.token for t in cut.logprobs.content] == tokens[: at + 2]
    reply = client.post("/v1/completions", json={"prompt": "12+", "max_tokens": 8, "temperature": 0, "stop": stop})
    text = client.post("/v1/completions", json={"prompt": "12+", "max_tokens": 8, "temperature": 0}).json()
    full_text = text["choices"][0]["text"]
    expected = full_text[: full_text.index(stop)] if stop in full_text else full_text
    assert reply.json()["choices"][0]["text"] == expected


def test_chat_template_kwargs_reach_the_template(client):
    tokenizer = client.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = original.replace(
        "{% if add_generation_prompt %}", "{% if hint %}HINT{% endif %}{% if add_generation_prompt %}"
    )
    try:
        plain = chat(client, max_tokens=1).usage.prompt_tokens
        hinted = chat(client, max_tokens=1, chat_template_kwargs={"hint": True}).usage.prompt_tokens
    finally:
        tokenizer.chat_template = original
    assert hinted == plain + len("HINT")


def test_text_completions_and_models(client):
    reply = client.post("/v1/completions", json={"model": "m", "prompt": ["12+", "3*"], "n": 2, "logprobs": 0})
    assert reply.status_code == 200, reply.text
    completion = Completion.model_validate(reply.json())
    assert completion.object == "text_completion" and [c.index for c in completion.choices] == [0, 1, 2, 3]
    for c in completion.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) <= 16  # OpenAI's default max_tokens
        assert c.logprobs.text_offset[0] == 0
    assert completion.usage.prompt_tokens == 5
    ids = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}).json()
    assert ids["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": USER, "n": 0}, "n"),
        ({"messages": USER, "max_tokens": "many"}, "max_tokens"),
        ({"messages": USER, "top_p": 0}, "top_p"),
        ({"messages": USER, "stop": [3]}, "stop"),
        ({"messages": USER, "stream": True}, "stream"),
        ({"messages": USER, "top_logprobs": 3, "logprobs": True}, "top_logprobs"),
        ({"messages": USER, "seed": 1.5}, "seed"),  # an integer: the samples' sampling_seed
        ({"messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        ({"messages": USER, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": "x" * 600}]}, "messages"),  # past the 512-token context
    ],
)
def test_bad_chat_requests_name_the_field(client, body, param):
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["message"].startswith(param)


def test_bad_completion_requests_name_the_field(client):
    for body, param in [({"prompt": None}, "prompt"), ({"prompt": "a", "logprobs": 2}, "logprobs")]:
        error = client.post("/v1/completions", json=body).json()["error"]
        assert error["param"] == param, error
    assert client.post("/v1/chat/completions", content=b"{not json").status_code == 400


@pytest.fixture(scope="module")
def qwen3_client(tmp_path_factory):
    """serve-model's app over an (untrained) qwen3-family tiny model: Qwen3's real template, BPE tokens."""
    path = save_tiny_model(
        tmp_path_factory.mktemp("qwen3"), hidden_size=32, num_layers=1, intermediate_size=64, family="qwen3"
    )
    tokenizer = load_tokenizer(path)
    engine = HFEngine(load_model(path), max_batch_size=4)
    with TestClient(build_app(engine, tokenizer, ModelServerConfig(model_path=str(path)))) as c:
        c.tokenizer = tokenizer
        yield c


def test_enable_thinking_false_renders_qwen3s_empty_think_block(qwen3_client):
    """Qwen3's template, told ``enable_thinking: false``, ends the prompt with an empty think block: the reply
    is generated after exactly those tokens (the same logprobs as /v1/completions on them)."""
    tokenizer = qwen3_client.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    endings = [
        ({}, "2+2?<|im_end|>\n<|im_start|>assistant\n"),
        ({"enable_thinking": False}, "2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ]
    for kwargs, ending in endings:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        assert text.endswith(ending)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        body = {"messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True}
        reply = qwen3_client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": kwargs or None})
        assert reply.status_code == 200, reply.text
        chat = ChatCompletion.model_validate(reply.json())
        assert chat.usage.prompt_tokens == len(prompt)
        same = qwen3_client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0}
        )
        expected = same.json()["choices"][0]["logprobs"]
        got = chat.choices[0].logprobs.content
        assert [t.token for t in got] == expected["tokens"]
        assert [t.logprob for t in got] == pytest.approx(expected["token_logprobs"], abs=1e-5)


def test_parser_flags_override_the_template_and_bad_names_stop_startup(tiny_dir, qwen3_client, capsys):
    server = qwen3_client.app.state.server
    assert chat_parser(server) == ReplyParser("hermes", "think")  # detected from Qwen3's template
    cfg = ModelServerConfig(model_path="m", tool_parser="none", reasoning_parser="none")
    assert chat_parser(ModelServer(server.engine, server.tokenizer, cfg)) == ReplyParser("none", "none")
    with pytest.raises(ArealAgentsError, match=r"tool_parser \(--tool-parser\).*hermes.*Did you mean 'hermes'"):
        ModelServerConfig(model_path="m", tool_parser="hermse")
    # the command fails before it loads the model (there is none at this path), naming the flag
    assert main(["serve-model", "--model-path", str(tiny_dir / "absent"), "--reasoning-parser", "deepthink"]) == 2
    err = capsys.readouterr().err
    assert "serve-model: error: reasoning_parser (--reasoning-parser)" in err and "think, harmony, none" in err


@pytest.mark.parametrize("family", ["deepseek-r1", "granite"])
def test_a_tool_loops_history_renders_as_the_template_reads_it(tmp_path, family):
    """A client sends back the OpenAI assistant message it got (``tool_calls`` with JSON-text arguments):
    DeepSeek-R1's template joins the arguments as text, Granite's renders no ``tool_calls`` and reads the call
    from the content. The prompt holds the call as the model would have written it, not a 400 or a lost call."""
    path = save_tiny_model(tmp_path, hidden_size=32, num_layers=1, intermediate_size=64, family=family)
    tokenizer = load_tokenizer(path)
    call = {"id": "c0ffee123", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0ffee123", "name": "add", "content": "5"},
    ]
    engine = HFEngine(load_model(path), max_batch_size=2)
    with TestClient(build_app(engine, tokenizer, ModelServerConfig(model_path=str(path)))) as c:
        reply = c.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        prompt_tokens = reply.json()["usage"]["prompt_tokens"]
    written = {"deepseek-r1": '<｜tool▁sep｜>add\n```json\n{"a": 2, "b": 3}\n```', "granite": '"name": "add"'}
    as_read = [messages[0], template_message(tokenizer.chat_template, messages[1]), messages[2]]
    text = tokenizer.apply_chat_template(as_read, tokenize=False, add_generation_prompt=True)
    assert written[family] in text
    assert prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
