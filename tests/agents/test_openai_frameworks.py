"""The `openai` SDK and a real agent framework (openai-agents), unchanged, complete a tool-calling conversation
(assistant tool call -> tool result -> final answer) against a real `serve-model` process and against the
capture proxy, for the char-level model and two real families: qwen3 (hermes calls, ``<think>`` reasoning in
``reasoning_content``) and mistral (``[TOOL_CALLS]`` with the model's own 9-character call ids). The tiny model
is taught the two replies by a few dozen SFT steps (`sft_update`; a family's targets are what its template has
the model write, `conversation_to_segments`) and decodes greedily, so it calls the tool without a scripted
engine."""

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from openai import AsyncOpenAI

from areal_agents.agents import ChatCapture, ChatProxy
from areal_agents.config import EngineConfig
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.local_servers import launch_servers
from areal_agents.engines.model_server.openai_shapes import plain_messages
from areal_agents.models import load_model, load_tokenizer, save_tiny_model
from areal_agents.trainers.sft import conversation_to_segments, sft_update
from areal_agents.types import SamplingParams, Trajectory

pytestmark = pytest.mark.process

SYSTEM = "You answer weather questions."
QUESTION = "What is the weather in Paris?"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RESULT = "sunny, 22 C"
STEPS = 100  # SFT steps at most (about 40 are needed)
ANSWER = "It is sunny in Paris."
# The tool as openai-agents sends it (its schema of `get_weather` below), so both clients send one prompt.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "properties": {"city": {"title": "City", "type": "string"}},
                "required": ["city"],
                "title": "get_weather_args",
                "type": "object",
                "additionalProperties": False,
            },
            "strict": True,
        },
    }
]
FAMILIES = ("char", "qwen3", "mistral")
CALL_ID = "w3aTh3r01"  # Mistral's template wants 9-character ids; the model writes it, the parser reads it
REASONING = {"qwen3": ("I should ask the weather tool.", "The tool says sunny.")}  # (call turn, answer turn)


@dataclass(frozen=True)
class ToolModel:
    """A trained model: its family, directory, the reasoning it writes before the call and the answer
    (None: none) and the tokens of its replies, segment by segment (what a capture trains: Mistral's
    template moves the system prompt after the call, a new segment)."""

    family: str
    path: Path
    reasoning: tuple[str | None, str | None]
    segments: list[list[int]]


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


def char_trajectories(tokenizer) -> list[Trajectory]:
    """The char-level template renders no ``tool_calls``: the call turn is learned as the hermes text, after
    the history both as clients send it back and as the capture keeps it."""
    trajectories = []
    for messages, reply in tool_conversations():
        text = tokenizer.apply_chat_template(
            plain_messages(messages), tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        prompt = tokenizer.encode(text, add_special_tokens=False)
        target = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        n = len(prompt) + len(target)
        trajectories.append(Trajectory(prompt + target, [0] * len(prompt) + [1] * len(target), [0.0] * n, [-1] * n))
    return trajectories


def family_conversation(family: str, call_reasoning: bool = True) -> list[dict]:
    """The conversation in OpenAI messages (the call turn's reasoning left out with ``call_reasoning=False``,
    as openai-agents sends a turn back)."""
    think_call, think_answer = REASONING.get(family, (None, None))
    function = {"name": "get_weather", "arguments": {"city": "Paris"}}
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": CALL_ID, "type": "function", "function": function}],
    }
    answer = {"role": "assistant", "content": ANSWER}
    if think_call and call_reasoning:
        call["reasoning_content"] = think_call
    if think_answer:
        answer["reasoning_content"] = think_answer
    tool = {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT}
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}, call, tool, answer]


def last_turn_only(traj: Trajectory) -> Trajectory:
    """``traj`` with loss on its last assistant turn only."""
    start = max(i for i, m in enumerate(traj.loss_mask) if m and (i == 0 or not traj.loss_mask[i - 1]))
    mask = [m if i >= start else 0 for i, m in enumerate(traj.loss_mask)]
    return Trajectory(traj.input_ids, mask, traj.logprobs, traj.versions)


def family_trajectories(family: str, tokenizer) -> list[Trajectory]:
    """The conversation through the family's template; where the call turn has reasoning, also the answer
    after the call turn without it (clients that drop ``reasoning_content`` send that prompt)."""
    trajectories = conversation_to_segments(family_conversation(family), tokenizer, tools=TOOLS)
    if family in REASONING:
        dropped = conversation_to_segments(family_conversation(family, call_reasoning=False), tokenizer, tools=TOOLS)
        trajectories.append(last_turn_only(dropped[-1]))
    return trajectories


def train_tool_model(out, family: str) -> ToolModel:
    """The tiny model of ``family``, SFT'd until greedy decoding writes the call then the answer (a few
    seconds on a CPU)."""
    save_tiny_model(out, hidden_size=64, num_layers=2, intermediate_size=128, family=family)
    tokenizer, model = load_tokenizer(out), load_model(out)
    if family == "char":
        trajectories = char_trajectories(tokenizer)
        segments = [loss_tokens(trajectories[0]) + loss_tokens(trajectories[2])]
    else:
        trajectories = family_trajectories(family, tokenizer)
        segments = [loss_tokens(t) for t in trajectories[: len(trajectories) - (family in REASONING)]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains as fast on one thread, and never spins against others
    try:
        learn(model, tokenizer, trajectories, family)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
    return ToolModel(family, Path(out), REASONING.get(family, (None, None)), segments)


def loss_tokens(traj: Trajectory) -> list[int]:
    return [t for t, m in zip(traj.input_ids, traj.loss_mask) if m]


def learn(model, tokenizer, trajectories: list[Trajectory], family: str) -> None:
    """SFT steps until greedy decoding writes every loss token of ``trajectories``."""
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
        raise AssertionError(f"{family}: the tool replies were not learned in {STEPS} steps (loss {stats['loss']:.3f})")


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


@pytest.fixture(scope="session", params=FAMILIES)
def tool_model(request, tmp_path_factory) -> ToolModel:
    return train_tool_model(tmp_path_factory.mktemp(f"tool_model_{request.param}"), request.param)


@pytest.fixture(scope="module")
def served(tool_model, tmp_path_factory):
    """A real serve-model process over the trained model: its OpenAI base URL."""
    group = launch_servers(
        EngineConfig(backend="serve-model"), str(tool_model.path), log_dir=tmp_path_factory.mktemp("logs")
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

    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:  # closed on this loop, not at GC
        agent = Agent(
            name="weather",
            instructions=SYSTEM,
            tools=[get_weather],
            model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
            model_settings=ModelSettings(temperature=0),
        )
        result = await Runner.run(agent, QUESTION, max_turns=3)
    return result.final_output, calls


def proxy_captures(path: Path) -> tuple[HFEngine, list[ChatCapture]]:
    """An in-process engine on the trained model and two sessions' captures over it (greedy, as the
    rollout sets)."""
    tokenizer = load_tokenizer(path)
    engine = HFEngine(load_model(path), max_batch_size=4, num_threads=1)
    sampling = SamplingParams(max_new_tokens=96, temperature=0)
    return engine, [ChatCapture(engine, tokenizer, sampling, episode_id=f"ep{i}") for i in range(2)]


def reasoning_of(choice) -> str | None:
    return (choice.message.model_extra or {}).get("reasoning_content")


def check_sdk_replies(tool_model: ToolModel, first, second) -> None:
    """The call turn: ``tool_calls`` and no content; the answer: content; each with the family's reasoning."""
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"
    assert [reasoning_of(first.choices[0]), reasoning_of(second.choices[0])] == list(tool_model.reasoning)
    if tool_model.family == "mistral":  # the id the model wrote, not a generated one
        assert first.choices[0].message.tool_calls[0].id == CALL_ID


def test_openai_sdk_tool_round_trip_against_serve_model(tool_model, served):
    async def run():
        async with AsyncOpenAI(base_url=served, api_key="none") as client:
            return await sdk_round_trip(client)

    first, second = asyncio.run(run())
    check_sdk_replies(tool_model, first, second)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_openai_agents_tool_round_trip_against_serve_model(served):
    final, calls = asyncio.run(agents_round_trip(served))
    assert calls == ["Paris"] and final == ANSWER


def test_sdk_and_agents_tool_round_trip_against_the_proxy(tool_model):
    engine, (sdk_capture, agents_capture) = proxy_captures(tool_model.path)

    async def run():
        proxy = ChatProxy()
        await proxy.start()
        try:
            sid = proxy.open(sdk_capture)
            async with AsyncOpenAI(base_url=proxy.base_url(sid), api_key=sid) as client:
                sdk = await sdk_round_trip(client)
            sid = proxy.open(agents_capture)
            agents = await agents_round_trip(proxy.base_url(sid), sid)
        finally:
            await proxy.stop()
            await engine.aclose()
        return sdk, agents

    (first, second), (final, calls) = asyncio.run(run())
    check_sdk_replies(tool_model, first, second)
    assert calls == ["Paris"] and final == ANSWER
    tokenizer = sdk_capture.tokenizer
    for capture in (sdk_capture, agents_capture):  # token-exact, segments where the template rewrites history
        trajectories = capture.trajectories()
        assert [loss_tokens(t) for t in trajectories] == tool_model.segments  # the tokens taught, as sampled
        assert RESULT in tokenizer.decode(trajectories[-1].input_ids)
        assert all(t.metadata["num_turns"] == 2 for t in trajectories)


def test_stop_strings_and_logprobs_on_the_trained_reply(tool_model, served):
    async def run():
        async with AsyncOpenAI(base_url=served, api_key="none") as client:
            return await weather_with_stop(client)

    async def weather_with_stop(client):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        call = {
            "id": CALL_ID,
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
        messages += [
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
        ]
        return await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, temperature=0, stop=[" in Paris"], logprobs=True, n=2
        )

    reply = asyncio.run(run())
    for choice in reply.choices:
        assert choice.message.content == "It is sunny" and choice.finish_reason == "stop"
        assert reasoning_of(choice) == tool_model.reasoning[1]
        text = "".join(t.token for t in choice.logprobs.content)  # the tokens through the stop string
        tail = text[text.index("It is sunny") :]
        assert tail.startswith("It is sunny in Paris") and ANSWER.startswith(tail)
