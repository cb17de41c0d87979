import shutil
import warnings

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import areal_agents  # noqa: F401
from areal_agents.envs.tools import ToolEnv, python_runner, tool_schema


def add(a: int, b: int, scale: float = 1.0) -> float:
    """Add two integers, then scale.

    Args:
        a: the first number.
        b: the second number.
        scale: multiplies the sum.
    """
    return (a + b) * scale


def boom() -> str:
    """Always fails."""
    raise RuntimeError("kaput")


def test_schema_from_signature_and_docstring():
    schema = tool_schema(add)["function"]
    assert schema["name"] == "add" and schema["description"] == "Add two integers, then scale."
    assert schema["parameters"]["required"] == ["a", "b"]
    assert schema["parameters"]["properties"]["scale"] == {"type": "number", "description": "multiplies the sum."}


def make():
    return ToolEnv(gym.make("areal_agents/Arithmetic-v0", max_turns=2), tools=[add, boom], max_tool_calls=3)


def test_tool_call_answers_as_a_tool_message_then_the_env_steps():
    env = make()
    obs, _ = env.reset(seed=0)
    assert "<tools>" in obs and '"name": "add"' in obs
    problem = env.unwrapped.problem
    obs, reward, terminated, _, info = env.step(
        f'Let me compute. <tool_call>{{"name": "add", "arguments": {{"a": {problem.a}, "b": {problem.b}}}}}</tool_call>'
    )
    assert info["role"] == "tool" and not terminated and reward == 0.0
    assert obs == f"<tool_response>\n{float(problem.a + problem.b)}\n</tool_response>"
    _, reward, terminated, _, _ = env.step(str(problem.answer))
    assert (reward, terminated) == (1.0, True)


@pytest.mark.parametrize(
    "call, message",
    [
        ("{not json", "not valid JSON"),
        ('{"name": "mul", "arguments": {}}', "unknown tool 'mul'"),
        ('{"name": "add", "arguments": {"a": 1}}', "bad arguments for add"),
        ('{"name": "boom", "arguments": {}}', "boom raised RuntimeError: kaput"),
    ],
)
def test_bad_calls_are_reported_and_the_episode_goes_on(call, message):
    env = make()
    env.reset(seed=0)
    obs, _, terminated, _, info = env.step(f"<tool_call>{call}</tool_call>")
    assert message in obs and not terminated and info["role"] == "tool"


def test_tool_call_budget():
    env = make()
    env.reset(seed=0)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    obs, *_ = env.step(call * 4)
    assert obs.count("<tool_response>") == 4 and "no tool calls left" in obs


def test_check_env_passes_on_the_wrapped_env():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*different from the unwrapped version")  # the wrapper is the point
        check_env(make())


@pytest.mark.process
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_code_runner_is_a_tool():
    env = ToolEnv(gym.make("areal_agents/Arithmetic-v0"), tools=[python_runner()])
    env.reset(seed=0)
    obs, *_ = env.step('<tool_call>{"name": "run_python", "arguments": {"code": "print(6*7)"}}</tool_call>')
    assert "status: ok" in obs and "42" in obs
