"""Turn order in process: `MultiAgentTextEnv.acting_agents`, the checker's rules for it, `PooledEnv.acting` after
each reset and step, and `MultiAgentChatAgent` generating for exactly the agents whose turn it is."""

import asyncio

import pytest

import areal_agents.envs.testing  # noqa: F401  (registers areal_agents_testing/Turns-v0)
from areal_agents.agents.multi_agent import MultiAgentChatAgent
from areal_agents.engines.base import InferenceEngine
from areal_agents.envs import check_multi_agent_env, make_env
from areal_agents.envs.runtime.pool import LocalEnvPool
from areal_agents.envs.testing import TurnsEnv
from areal_agents.types import GenResponse, SamplingParams

TURNS = "areal_agents_testing/Turns-v0"


def test_a_turn_based_env_passes_the_checker():
    check_multi_agent_env(make_env(TURNS, num_agents=3, turns=7))
    env = make_env("areal_agents/Debate-v0", task_kwargs={"digits": 1})
    env.reset(seed=0)
    assert env.acting_agents() == ["debater_0", "debater_1"]  # the default: every live agent


class ActsForTheDeparted(TurnsEnv):
    def acting_agents(self):
        return ["ghost"] if self.agents else []


class NobodyActs(TurnsEnv):
    def acting_agents(self):
        return []


class RewardsOnlyTheNext(TurnsEnv):
    def step(self, actions):
        observations, rewards, done, truncated, infos = super().step(actions)
        return observations, {}, done, truncated, infos


@pytest.mark.parametrize(
    "env, message",
    [
        (ActsForTheDeparted(), r"acting_agents\(\) \['ghost'\] to be live agents"),
        (NobodyActs(), r"acting_agents\(\) to be non-empty after reset"),
        (RewardsOnlyTheNext(), r"step\(\) rewards keys \['p0'\], got \[\] \(at least the acting agents\)"),
    ],
)
def test_the_checker_names_turn_order_mistakes(env, message):
    with pytest.raises(AssertionError, match=message):
        check_multi_agent_env(env)


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_pooled_envs_follow_the_turn_order(mode):
    async def play():
        pool = LocalEnvPool(mode, workers=1)
        env = pool.make(TURNS, num_agents=2, turns=3)
        assert env.multi_agent and env.agents == ["p0", "p1"] and env.acting is None
        await env.areset(seed=0)
        order = []
        while env.acting:
            order.append(env.acting[0])
            await env.astep({env.acting[0]: "hi"})
        single = pool.make("areal_agents/Arithmetic-v0")
        await single.areset(seed=0)
        assert not single.multi_agent and single.acting is None
        await env.aclose()
        await single.aclose()
        await pool.aclose()
        return order

    assert asyncio.run(play()) == ["p0", "p1", "p0"]


class Scripted(InferenceEngine):
    def __init__(self, tokenizer, text):
        self.tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.prompts = {}

    async def agenerate(self, request):
        self.prompts[request.rid] = request.input_ids
        return GenResponse(list(self.tokens), [-0.5] * len(self.tokens), [0] * len(self.tokens), "stop")


def test_the_agent_plays_in_turn_and_hears_the_others_before_its_turn(tokenizer):
    engine = Scripted(tokenizer, "hi")
    agent = MultiAgentChatAgent(engine, tokenizer, SamplingParams(max_new_tokens=4))

    async def play():
        pool = LocalEnvPool("inline")
        trajectories = await agent.run_episode(pool.make(TURNS, num_agents=2, turns=3), seed=0, episode_id="ep")
        await pool.aclose()
        return {t.agent_id: t for t in trajectories}

    trajectories = asyncio.run(play())
    assert list(engine.prompts) == ["ep/p0/t0", "ep/p1/t1", "ep/p0/t2"]
    assert "p0: hi" in tokenizer.decode(engine.prompts["ep/p1/t1"])  # p1 heard p0 before its first turn
    assert "p1: hi" in tokenizer.decode(engine.prompts["ep/p0/t2"])
    assert trajectories["p0"].turn_rewards == [1.0, 1.0] and trajectories["p1"].turn_rewards == [1.0]
    assert trajectories["p1"].metadata["info"] == {"turn": 3, "role": "user"}  # its final info, while not acting
