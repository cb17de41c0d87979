"""`MultiAgentChatAgent` on the debate env: one trajectory per agent, each loss mask exactly that agent's
own generated tokens, other agents' answers only as observations; policies routed by agent id."""

import asyncio

from test_segments import InlineEnv

from areal_agents.agents.multi_agent import MultiAgentChatAgent
from areal_agents.engines import HFEngine
from areal_agents.engines.base import InferenceEngine
from areal_agents.envs import make_env
from areal_agents.types import GenResponse, SamplingParams


class PerAgentEngine(InferenceEngine):
    """Answers ``text`` for every request; remembers the requests it saw."""

    def __init__(self, tokenizer, text):
        self.tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.rids = []

    async def agenerate(self, request):
        self.rids.append(request.rid)
        return GenResponse(list(self.tokens), [-0.5] * len(self.tokens), [0] * len(self.tokens), "stop")


def play(agent, **env_kwargs):
    env = InlineEnv(make_env("areal_agents/Debate-v0", task_kwargs={"digits": 1}, **env_kwargs))
    return asyncio.run(agent.run_episode(env, seed=3, episode_id="ep"))


def test_separate_policies_each_get_only_their_agents_turns(tokenizer):
    engines = {"debater_0": PerAgentEngine(tokenizer, "11"), "debater_1": PerAgentEngine(tokenizer, "22")}
    agent = MultiAgentChatAgent(engines, tokenizer, SamplingParams(max_new_tokens=8))
    trajectories = play(agent, rounds=3)
    assert sorted(t.agent_id for t in trajectories) == ["debater_0", "debater_1"]
    assert all(r.startswith("ep/debater_0/") for r in engines["debater_0"].rids) and len(engines["debater_0"].rids) == 3
    assert all(r.startswith("ep/debater_1/") for r in engines["debater_1"].rids) and len(engines["debater_1"].rids) == 3
    for t in trajectories:
        own = engines[t.agent_id].tokens
        assert [x for x, m in zip(t.input_ids, t.loss_mask) if m] == own * 3  # exactly its three answers
        other = "22" if t.agent_id == "debater_0" else "11"
        prompt = tokenizer.decode([x for x, m in zip(t.input_ids, t.loss_mask) if not m])
        assert prompt.count(other) == 2  # the other's answers, read in rounds 2 and 3, never trained on
        assert t.turn_rewards[:2] == [0.0, 0.0] and len(t.turn_rewards) == 3
        assert t.episode_id == f"ep/{t.agent_id}" and t.metadata["info"]["rounds"] == 3


def test_shared_policy_plays_every_agent(tokenizer):
    engine = PerAgentEngine(tokenizer, "9")
    agent = MultiAgentChatAgent(engine, tokenizer, SamplingParams(max_new_tokens=8))
    trajectories = play(agent, num_agents=3, rounds=2)
    assert sorted(t.agent_id for t in trajectories) == ["debater_0", "debater_1", "debater_2"]
    assert len(engine.rids) == 6
    assert len({t.reward for t in trajectories}) == 1  # same answers, same rewards
    assert all("success" in t.metadata for t in trajectories)


class RecordingEngine(HFEngine):
    """The real engine, also keeping every response it returned, by request id."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.responses = {}

    async def agenerate(self, request):
        self.responses[request.rid] = response = await super().agenerate(request)
        return response


def test_each_agent_keeps_its_stop_reasons_and_a_cut_for_want_of_room(model, tokenizer):
    """Each agent's trajectory holds the engine's stop reason of each of its turns; when a conversation has
    no room left the episode ends, and every agent still acting is marked ``context_exhausted``."""
    engine = RecordingEngine(model, seed=0)
    free = play(MultiAgentChatAgent(engine, tokenizer, SamplingParams(max_new_tokens=3)), rounds=2)
    for t in free:
        reasons = [r.stop_reason for rid, r in engine.responses.items() if rid.startswith(f"{t.episode_id}/")]
        assert t.metadata["stop_reasons"] == reasons and len(reasons) == 2
        assert not t.metadata["context_exhausted"]
    room = max(t.loss_mask.index(1) for t in free) + 3  # the first turn fits, the second does not
    engine.responses.clear()
    cut = play(
        MultiAgentChatAgent(engine, tokenizer, SamplingParams(max_new_tokens=3), max_total_tokens=room), rounds=2
    )
    assert sorted(rid.rsplit("/", 1)[1] for rid in engine.responses) == ["t0", "t0"]  # one turn each
    for t in cut:
        assert t.metadata["context_exhausted"] and len(t.metadata["stop_reasons"]) == 1
