"""The HTTP chat proxy's sessions and errors, and `ToolAgent` answering tool calls itself."""

import asyncio

import httpx
import pytest
from test_segments import InlineEnv, ScriptedEngine, TwoTurns

from areal_agents.agents import ChatCapture, ChatProxy, ToolAgent
from areal_agents.types import SamplingParams


@pytest.mark.process
def test_proxy_sessions_by_path_api_key_and_header(tokenizer):
    engine = ScriptedEngine(tokenizer, ["8", "7", "6"])
    capture = ChatCapture(engine, tokenizer, SamplingParams(max_new_tokens=8), episode_id="ep")

    async def scenario():
        proxy = ChatProxy()
        await proxy.start()
        sid = proxy.open(capture)
        body = {"model": "m", "messages": [{"role": "user", "content": "3+4?"}]}
        try:
            async with httpx.AsyncClient() as http:
                by_path = await http.post(f"{proxy.base_url(sid)}/chat/completions", json=body)
                root = f"http://{proxy.host}:{proxy.port}"
                by_key = await http.post(
                    f"{root}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {sid}"}
                )
                by_header = await http.post(f"{root}/v1/chat/completions", json=body, headers={"X-Session-Id": sid})
                unknown = await http.post(f"{root}/s/nope/v1/chat/completions", json=body)
                no_session = await http.post(f"{root}/v1/chat/completions", json=body)
                bad = await http.post(f"{proxy.base_url(sid)}/chat/completions", json={"model": "m"})
                stream = await http.post(f"{proxy.base_url(sid)}/chat/completions", json={**body, "stream": True})
                reward = await http.post(f"{root}/s/{sid}/reward", json={"reward": 0.5})
                bad_reward = await http.post(f"{root}/s/{sid}/reward", json={"reward": "high"})
        finally:
            await proxy.stop()
        return by_path, by_key, by_header, unknown, no_session, bad, stream, reward, bad_reward

    by_path, by_key, by_header, unknown, no_session, bad, stream, reward, bad_reward = asyncio.run(scenario())
    assert [r.status_code for r in (by_path, by_key, by_header)] == [200, 200, 200]
    assert [r.json()["choices"][0]["message"]["content"] for r in (by_path, by_key, by_header)] == ["8", "7", "6"]
    assert unknown.status_code == 404 and "unknown session 'nope'" in unknown.json()["detail"]
    assert no_session.status_code == 401
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"  # OpenAI's error shape
    assert stream.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert "stream" in stream.json()["error"]["message"]
    assert reward.status_code == 200 and capture.reward == 0.5
    assert bad_reward.status_code == 400
    assert len(capture.trajectories()) == 3  # three independent conversations: three segments


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


def test_tool_agent_answers_calls_without_stepping_the_env(tokenizer):
    call = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    engine = ScriptedEngine(tokenizer, [call, "7", "7"])
    agent = ToolAgent(engine, tokenizer, SamplingParams(max_new_tokens=64), tools=[add])
    (traj,) = asyncio.run(agent.run_episode(InlineEnv(TwoTurns()), seed=0, episode_id="ep"))
    assert '"name": "add"' in traj.metadata["messages"][0]["content"]  # the tool list, in the system prompt
    assert traj.metadata["messages"][3] == {"role": "tool", "content": "<tool_response>\n7\n</tool_response>"}
    assert traj.turn_rewards == [0.0, 1.0]  # the tool turn did not step the env
    loss = [t for t, m in zip(traj.input_ids, traj.loss_mask) if m]
    assert loss == engine.outputs[0] + engine.outputs[1] + engine.outputs[2]


@pytest.mark.parametrize("spec", ["areal_agents.agents:ChatAgent", ""])
def test_make_agent_builds_the_default_and_named_agents(spec, tokenizer):
    from areal_agents.agents import ChatAgent, make_agent

    agent = make_agent(spec, ScriptedEngine(tokenizer, []), tokenizer, SamplingParams(), system_prompt="hi")
    assert type(agent) is ChatAgent and agent.system_prompt == "hi"


def test_make_agent_errors_name_the_field(tokenizer):
    from areal_agents.agents import make_agent
    from areal_agents.errors import ArealAgentsError

    with pytest.raises(ArealAgentsError, match="rollout.agent 'areal_agents.agents:ToolAgent': cannot build"):
        make_agent("areal_agents.agents:ToolAgent", None, tokenizer, SamplingParams())  # no tools=
    with pytest.raises(ArealAgentsError, match="rollout.agent 'json:dumps': expects an agent class"):
        make_agent("json:dumps", None, tokenizer, SamplingParams())


class PlainAgent:
    """An agent class as the docs allow one: ``run_episode`` alone, no base class."""

    def __init__(self, engine, tokenizer, sampling):
        self.closed = False

    async def run_episode(self, env, *, seed, episode_id):
        return []


class ClosingAgent(PlainAgent):
    async def aclose(self):
        self.closed = True


class NotAnAgent:
    def __init__(self, engine, tokenizer, sampling):
        pass


def test_make_agent_gives_a_class_without_a_base_the_protocols_aclose(tokenizer):
    """The recipe closes every agent: a configured class that does not derive from `Agent` gets its default
    ``aclose`` (nothing), one with its own keeps it; a class without ``run_episode`` is refused."""
    from areal_agents.agents import Agent, make_agent
    from areal_agents.errors import ConfigError

    plain = make_agent(f"{__name__}:PlainAgent", None, tokenizer, SamplingParams())
    assert isinstance(plain, PlainAgent) and Agent in type(plain).__mro__ and type(plain).__name__ == "PlainAgent"
    asyncio.run(plain.aclose())
    assert not plain.closed
    closing = make_agent(f"{__name__}:ClosingAgent", None, tokenizer, SamplingParams())
    asyncio.run(closing.aclose())
    assert closing.closed
    with pytest.raises(ConfigError, match="an agent needs `async def run_episode"):
        make_agent(f"{__name__}:NotAnAgent", None, tokenizer, SamplingParams())


def test_a_malformed_call_is_counted_and_answered_by_the_agent_and_by_tool_env(tokenizer):
    """Tools on the agent's side (ToolAgent) or the env's (ToolEnv): a call whose JSON is broken reaches the model
    as an error it can answer, and the episode's trajectories count it (rollout/tool_parse_failures)."""

    from areal_agents.agents import ChatAgent
    from areal_agents.envs.tools import ToolEnv

    broken = '<tool_call>{"name": "add", "arguments": {"a": 3,}}</tool_call>'
    call = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    for make in (
        lambda engine: (ToolAgent(engine, tokenizer, SamplingParams(max_new_tokens=64), tools=[add]), TwoTurns()),
        lambda engine: (
            ChatAgent(engine, tokenizer, SamplingParams(max_new_tokens=64)),
            ToolEnv(TwoTurns(), tools=[add]),
        ),
    ):
        engine = ScriptedEngine(tokenizer, [broken, call, "7", "7"])
        agent, env = make(engine)
        (traj,) = asyncio.run(agent.run_episode(InlineEnv(env), seed=0, episode_id="ep"))
        assert (traj.metadata["tool_parse_failures"], traj.metadata["tool_calls"]) == (1, 1)
        second_prompt = tokenizer.decode(engine.prompts[1])
        assert "error: the tool call is not valid JSON" in second_prompt  # what the model reads next
        assert "<tool_response>\n7\n</tool_response>" in tokenizer.decode(engine.prompts[2])
