"""The `openai` SDK and a real agent framework (openai-agents), unchanged, complete a tool-calling conversation
(assistant tool call -> tool result -> final answer) against a real `serve-model` process and against the
capture proxy. The tiny model is taught the two replies by a few dozen SFT steps (`sft_update`) and decodes
greedily, so it calls the tool without a scripted engine."""

import asyncio
import json

import pytest
import torch
from openai import AsyncOpenAI

from areal_agents.agents import ChatCapture, ChatProxy
from areal_agents.config import EngineConfig
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.local_servers import launch_servers
from areal_agents.engines.model_server.openai_shapes import plain_messages
from areal_agents.models import load_model, load_tokenizer, save_tiny_model
from areal_agents.trainers.sft import sft_update
from areal_agents.types import SamplingParams, Trajectory

SYSTEM = "You answer weather questions."
QUESTION = "What is the weather in Paris?"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RESULT = "sunny, 22 C"
STEPS = 100  # SFT steps at most (about 40 are needed)
ANSWER = "It is sunny in Paris."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def tool_conversations() -> list[tuple[list[dict], str]]:
    """(messages, the reply to learn) for both turns; the tool-call turn as clients send it back (content
    empty, ``tool_calls``) and as the capture keeps it (the generated text: this template renders no
    ``tool_calls``)."""
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    tool = {"role": "tool", "tool_call_id": "c1", "content": RESULT}
    sent_back = {"role": "assistant", "content": None, "tool_calls": [call]}
    as_generated = {"role": "assistant", "content": CALL}
    return [(first, CALL), ([*first, sent_back, tool], ANSWER), ([*first, as_generated, tool], ANSWER)]


def train_tool_model(out) -> None:
    """The tiny model, SFT'd until greedy decoding writes ``CALL`` then ``ANSWER`` (about 10 s on a CPU)."""
    save_tiny_model(out, hidden_size=64, num_layers=2, intermediate_size=128)
    tokenizer, model = load_tokenizer(out), load_model(out)
    trajectories = []
    for messages, reply in tool_conversations():
        text = tokenizer.apply_chat_template(
            plain_messages(messages), tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        prompt = tokenizer.encode(text, add_special_tokens=False)
        target = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        n = len(prompt) + len(target)
        trajectories.append(Trajectory(prompt + target, [0] * len(prompt) + [1] * len(target), [0.0] * n, [-1] * n))
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.05, 1 - step / STEPS))
    for _ in range(STEPS):
        stats = sft_update(
            model,
            optimizer,
            scheduler,
            trajectories,
            micro_batch_tokens=4096,
            max_grad_norm=1.0,
            pad_token_id=tokenizer.pad_token_id,
        )
        if stats["loss"] < 0.5 and greedy_writes(model, trajectories):
            break
    else:
        raise AssertionError(f"the tool replies were not learned in {STEPS} steps (loss {stats['loss']:.3f})")
    model.save_pretrained(out)


def greedy_writes(model, trajectories: list[Trajectory]) -> bool:
    """Whether each loss token is the model's most likely next token after the tokens before it."""
    model.eval()
    with torch.no_grad():
        for t in trajectories:
            ids = torch.tensor([t.input_ids])
            best = model(ids).logits[0, :-1].argmax(-1)
            mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
            if not torch.equal(best[mask], ids[0, 1:][mask]):
                return False
    return True


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("tool_model")
    train_tool_model(out)
    return out


@pytest.fixture(scope="module")
def served(tool_model, tmp_path_factory):
    """A real serve-model process over the trained model: its OpenAI base URL."""
    group = launch_servers(
        EngineConfig(backend="serve-model"), str(tool_model), log_dir=tmp_path_factory.mktemp("logs")
    )
    yield f"{group.addresses[0]}/v1"
    group.stop()


async def sdk_round_trip(client: AsyncOpenAI) -> tuple:
    """The openai SDK's tool loop: the model calls get_weather, gets its result, answers."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=0)
    message = first.choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=0)
    return first, second


async def agents_round_trip(base_url: str, api_key: str = "none"):
    """openai-agents' `Runner.run` with a function tool, through its Chat Completions model."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no network: traces are not exported
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return RESULT

    agent = Agent(
        name="weather",
        instructions=SYSTEM,
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key)),
        model_settings=ModelSettings(temperature=0),
    )
    result = await Runner.run(agent, QUESTION, max_turns=3)
    return result.final_output, calls


def capture_proxy_session(tool_model):
    """A proxy with one session over an in-process engine on the trained model (greedy, as the rollout sets)."""
    tokenizer = load_tokenizer(tool_model)
    engine = HFEngine(load_model(tool_model), max_batch_size=4)
    capture = ChatCapture(engine, tokenizer, SamplingParams(max_new_tokens=96, temperature=0), episode_id="ep")
    return engine, capture


def loss_text(tokenizer, traj) -> str:
    return tokenizer.decode([t for t, m in zip(traj.input_ids, traj.loss_mask) if m], skip_special_tokens=False)


def test_openai_sdk_tool_round_trip_against_serve_model(served):
    async def run():
        return await sdk_round_trip(AsyncOpenAI(base_url=served, api_key="none"))

    first, second = asyncio.run(run())
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_openai_agents_tool_round_trip_against_serve_model(served):
    final, calls = asyncio.run(agents_round_trip(served))
    assert calls == ["Paris"] and final == ANSWER


def test_sdk_and_agents_tool_round_trip_against_the_proxy(tool_model):
    engine, sdk_capture = capture_proxy_session(tool_model)
    tokenizer = sdk_capture.tokenizer
    _, agents_capture = capture_proxy_session(tool_model)
    agents_capture.engine = engine  # one engine for both sessions

    async def run():
        proxy = ChatProxy()
        await proxy.start()
        try:
            sid = proxy.open(sdk_capture)
            sdk = await sdk_round_trip(AsyncOpenAI(base_url=proxy.base_url(sid), api_key=sid))
            sid = proxy.open(agents_capture)
            agents = await agents_round_trip(proxy.base_url(sid), sid)
        finally:
            await proxy.stop()
            await engine.aclose()
        return sdk, agents

    (first, second), (final, calls) = asyncio.run(run())
    assert first.choices[0].finish_reason == "tool_calls" and second.choices[0].message.content == ANSWER
    assert calls == ["Paris"] and final == ANSWER
    for capture in (sdk_capture, agents_capture):  # each conversation one trajectory, token-exact
        (traj,) = capture.trajectories()
        eos = tokenizer.eos_token
        assert loss_text(tokenizer, traj) == CALL + eos + ANSWER + eos
        assert RESULT in tokenizer.decode(traj.input_ids) and traj.metadata["num_turns"] == 2


def test_stop_strings_and_logprobs_on_the_trained_reply(served):
    async def run():
        client = AsyncOpenAI(base_url=served, api_key="none")
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        messages += [
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": RESULT},
        ]
        return await client.chat.completions.create(
            model="policy", messages=messages, temperature=0, stop=[" in Paris"], logprobs=True, n=2
        )

    reply = asyncio.run(run())
    for choice in reply.choices:
        assert choice.message.content == "It is sunny" and choice.finish_reason == "stop"
        assert "".join(t.token for t in choice.logprobs.content) == "It is sunny in Paris"
