"""A chat template that rewrites history (drops old <think> blocks): new segment, no re-tokenization, one advantage."""

import asyncio

import pytest

from areal_agents.agents import ChatAgent
from areal_agents.engines.base import InferenceEngine
from areal_agents.envs import TextEnv
from areal_agents.trainers.advantages import group_advantages
from areal_agents.types import GenResponse, SamplingParams

# Like Qwen3's: the reasoning of earlier assistant turns is dropped when the conversation goes on.
THINK_DROPPING_TEMPLATE = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}{% set content = content.split('</think>')[-1] %}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TwoTurns(TextEnv):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.turn = 0
        return "What is 3+4?", {}

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return "Try again.", 0.0, False, False, {}
        return "", 1.0, True, False, {}


class InlineEnv:
    """The `AsyncEnv` calls on a local env object."""

    def __init__(self, env):
        self.env = env
        self.acting = None  # a multi-agent env here is parallel: its agent follows the observations

    async def areset(self, *, seed=None, options=None):
        return self.env.reset(seed=seed, options=options)

    async def astep(self, action):
        return self.env.step(action)

    async def aclose(self):
        self.env.close()


class ScriptedEngine(InferenceEngine):
    """Returns fixed completions, as token ids, in order."""

    def __init__(self, tokenizer, texts):
        self.outputs = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
        self.prompts = []

    async def agenerate(self, request):
        self.prompts.append(request.input_ids)
        tokens = self.outputs[len(self.prompts) - 1]
        return GenResponse(tokens, [-0.5] * len(tokens), [3] * len(tokens), "stop")


@pytest.fixture
def thinking_tokenizer(tokenizer):
    tokenizer.chat_template = THINK_DROPPING_TEMPLATE
    return tokenizer


def test_history_rewrite_starts_a_new_segment_without_retokenizing(thinking_tokenizer):
    tok = thinking_tokenizer
    engine = ScriptedEngine(tok, ["<think>hmm</think>8", "<think>oh</think>7"])
    agent = ChatAgent(engine, tok, SamplingParams(max_new_tokens=32))
    env = InlineEnv(TwoTurns())
    first, second = asyncio.run(agent.run_episode(env, seed=0, episode_id="ep"))

    assert (first.metadata["segment"], second.metadata["segment"]) == (0, 1)
    assert first.episode_id == second.episode_id == "ep" and first.reward == second.reward == 1.0
    # each segment's loss tokens are exactly what the engine produced for its turn
    assert [t for t, m in zip(first.input_ids, first.loss_mask) if m] == engine.outputs[0]
    assert [t for t, m in zip(second.input_ids, second.loss_mask) if m] == engine.outputs[1]
    assert first.versions[-1] == 3 and first.logprobs[-1] == -0.5
    # the second prompt is the template's rewritten history: the old <think> is gone, the answer stays
    prompt2 = tok.decode(engine.prompts[1])
    assert "hmm" not in prompt2 and "8<|im_end|>" in prompt2 and "Try again." in prompt2
    assert second.input_ids[: len(engine.prompts[1])] == engine.prompts[1]


def test_segments_of_one_episode_share_one_advantage():
    # group g: episode A (two segments, reward 1) and episode B (one segment, reward 0)
    adv = group_advantages([1.0, 1.0, 0.0], ["g", "g", "g"], "grpo", episode_ids=["A", "A", "B"])
    assert adv[0] == adv[1] and adv[0] > 0 > adv[2]
    assert abs(float(adv[0]) - 1.0) < 1e-4 and abs(float(adv[2]) + 1.0) < 1e-4  # as if two episodes
    rloo = group_advantages([1.0, 1.0, 0.0], ["g", "g", "g"], "rloo", episode_ids=["A", "A", "B"])
    assert rloo.tolist() == [1.0, 1.0, -1.0]
