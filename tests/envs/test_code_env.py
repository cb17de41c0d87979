"""Code-v0 as an agent plays it: run on the examples, read the feedback, submit, get judged."""

import json
import shutil
import time
import warnings

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import areal_agents  # noqa: F401
from areal_agents.data.builtin import BUILTIN
from areal_agents.envs.runtime.budget import call_deadline

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
LEAP = "y = int(input())\nprint(366 if (y % 4 == 0 and y % 100 != 0) or y % 400 == 0 else 365)\n"


def rows(name):
    """The rows of bundled set ``name``."""
    return [json.loads(line) for line in BUILTIN[name].path().read_text().splitlines()]


def index_of(qid, name="lcb_v5_subset"):
    return next(i for i, r in enumerate(rows(name)) if r["question_id"] == qid)


@pytest.mark.parametrize("memory_mb", [10**7, 1, 512.5, "1024"])
def test_a_sandbox_memory_outside_its_bounds_is_refused(memory_mb):
    with pytest.raises(ValueError, match=r"memory_mb to be an int in \[64, 8192\]"):
        gym.make("areal_agents/Code-v0", dataset="mbpp", memory_mb=memory_mb)


@pytest.mark.process
def test_run_then_submit_stdin_problem():
    env = gym.make("areal_agents/Code-v0", dataset="lcb_v5_subset", max_turns=4, max_runs=1)
    obs, info = env.reset(options={"index": index_of("abc365_a")})
    assert "standard input" in obs and "```python run" in obs
    wrong = "print(365)\n"
    obs, reward, terminated, _, info = env.step(f"Let me test:\n```python run\n{wrong}```")
    assert (reward, terminated, info["runs"]) == (0.0, False, 1)
    assert "example 1: pass" in obs and "example 2: wrong_answer" in obs
    obs, reward, terminated, _, _ = env.step(f"```python run\n{LEAP}```")
    assert obs.startswith("No runs left") and not terminated
    _, reward, terminated, _, info = env.step(f"Final:\n```python\n{LEAP}```")
    assert (reward, terminated) == (1.0, True) and info["passed"] == info["total"] > 0


@pytest.mark.process
def test_functional_problem_and_partial_reward():
    env = gym.make("areal_agents/Code-v0", dataset="lcb_hidden3", partial_reward=True)
    obs, _ = env.reset(options={"index": index_of("2727", "lcb_hidden3")})
    assert "class Solution" in obs
    solution = (
        "class Solution:\n    def countSeniors(self, details):\n"
        "        return sum(int(d[11:13]) > 60 for d in details)\n"
    )
    _, reward, terminated, _, info = env.step(f"```python\n{solution}```")
    assert (reward, terminated) == (1.0, True)


def test_no_code_then_out_of_turns():
    env = gym.make("areal_agents/Code-v0", dataset="lcb_v5_subset", max_turns=2)
    env.reset(seed=0)
    obs, reward, terminated, _, _ = env.step("I think it is easy.")
    assert obs.startswith("No code block") and not terminated
    _, reward, terminated, _, _ = env.step("Still no code.")
    assert (reward, terminated) == (0.0, True)


@pytest.mark.process
def test_check_env_and_pickling():
    import pickle

    env = gym.make("areal_agents/Code-v0", dataset="lcb_v5_subset")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    env.reset(seed=1)
    assert len(pickle.dumps(env)) < 50_000


@pytest.mark.process
def test_code_env_through_the_env_server_in_worker_processes():
    import asyncio

    from areal_agents.envs.runtime.remote import EnvServerProcess, RemoteEnvPool

    async def play(url):
        pool = RemoteEnvPool(url)
        try:
            env = pool.make("areal_agents/Code-v0", dataset="lcb_v5_subset")
            await env.areset(options={"index": index_of("abc365_a")})
            result = await env.astep(f"```python\n{LEAP}```")
            await env.aclose()
            return result
        finally:
            await pool.aclose()

    with EnvServerProcess(mode="process", workers=2) as server:
        _, reward, terminated, _, info = asyncio.run(play(server.url))
    assert (reward, terminated) == (1.0, True) and info["passed"] == info["total"]


@pytest.mark.process
def test_a_served_step_ends_by_the_servers_deadline_whatever_timeout_s_asks():
    """Served, a client's ``timeout_s=90`` is cut to the server's step timeout: the infinite loop is killed
    then, as a timeout verdict, and the thread running the step is free again (the issue's 504s)."""
    env = gym.make("areal_agents/Code-v0", timeout_s=90, max_runs=0).unwrapped
    env.reset(seed=0)
    start = time.monotonic()
    with call_deadline(2.0):
        _, reward, terminated, _, info = env.step("```python\nwhile True:\n    pass\n```")
    assert (reward, terminated) == (0.0, True) and set(info["statuses"]) == {"timeout"}, info
    assert time.monotonic() - start < 60  # a generous liveness bound: the loop's own limit was 90 s
    with pytest.raises(ValueError, match="timeout_s"):
        gym.make("areal_agents/Code-v0", timeout_s="90")
