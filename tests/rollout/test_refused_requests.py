"""A request the engine refuses (a prompt past the model's context) is not retried, and an agent on an
in-process engine ends such an episode as truncated instead of sending it."""

import asyncio

import gymnasium as gym

from areal_agents.agents.chat_agent import ChatAgent
from areal_agents.engines import HFEngine
from areal_agents.engines.hf.request_checks import RequestError
from areal_agents.envs.base import TextEnv
from areal_agents.envs.runtime.pool import LocalEnvPool
from areal_agents.models import load_model
from areal_agents.rollout.controller import RolloutController
from areal_agents.types import SamplingParams


class Refusing:
    """An agent whose engine refuses every request, as a too-long prompt is refused."""

    def __init__(self):
        self.calls = 0

    async def run_episode(self, env, *, seed, episode_id):
        self.calls += 1
        raise RequestError("input_ids: 5000 tokens do not fit the model's context of 512")


class Long(TextEnv):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "x" * 2000, {}

    def step(self, action):
        return "", 1.0, True, False, {}


gym.register(id="test_refused/Long-v0", entry_point=Long)


def test_a_refused_request_is_not_retried():
    agent = Refusing()
    controller = RolloutController(
        agent, lambda: None, lambda i: i, batch_size=1, group_size=2, get_version=lambda: 0, max_retries=3
    )

    async def scenario():
        task = asyncio.ensure_future(controller.get_batch())
        await asyncio.sleep(0.3)
        task.cancel()
        await controller.aclose()

    asyncio.run(scenario())
    assert controller.runner.retries == 0 and controller.ledger.engine_failed >= 2
    assert agent.calls == controller.ledger.submitted  # one attempt each


def test_an_agent_on_an_in_process_engine_ends_an_over_long_prompt_as_truncated(tiny_dir, tokenizer):
    engine = HFEngine(load_model(tiny_dir))
    agent = ChatAgent(engine, tokenizer, SamplingParams(max_new_tokens=8))

    async def scenario():
        try:
            env = LocalEnvPool("inline").make("test_refused/Long-v0")
            return await agent.run_episode(env, seed=0, episode_id="ep")
        finally:
            await engine.aclose()

    assert asyncio.run(scenario()) == []  # no request sent, nothing to train on, no error
