"""Custom agent logic without touching the core, on the real tiny model and HF engine: (a) a ChatAgent
subclass with its own parser, (b) an async episode function on the OpenAI-style client, (c) an agent
program in another process on the HTTP chat proxy. Each: the loss mask covers exactly the model's own
tokens, the behavior logprobs equal a fresh forward pass of the weights, and 2 training steps run."""

import asyncio
import json
import sys
import textwrap

import pytest
import torch

from areal_agents.agents.factory import make_agent
from areal_agents.cli import main
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.envs.runtime.pool import LocalEnvPool
from areal_agents.models import load_model
from areal_agents.trainers.batching import make_micro_batches, token_logprobs
from areal_agents.types import SamplingParams

SEPARATE_PROCESS = pytest.param("separate_process", marks=pytest.mark.process)  # CommandAgent runs a program
USER_AGENTS = '''
from areal_agents.agents import ChatAgent


class DigitsOnly(ChatAgent):
    """A custom observation format and parser: the env receives only the digits of the reply."""

    def format_observation(self, observation, info):
        return "Q: " + observation

    def parse_action(self, text):
        return "".join(c for c in text if c.isdigit()) or text


async def ask_twice(client, task):
    """Two calls: an answer, then a second look; the env scores the final answer."""
    messages = [{"role": "user", "content": task.prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [first.choices[0].message, {"role": "user", "content": "Sure?"}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    await task.step(second.choices[0].message.content)
'''

AGENT_PROGRAM = """
import asyncio, json, sys
from openai import AsyncOpenAI


async def main():
    task = json.loads(sys.stdin.read())
    client = AsyncOpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the trainer
    messages = [{"role": "user", "content": task["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    print(json.dumps({"answer": second.choices[0].message.content}))


asyncio.run(main())
"""


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    (tmp_path / "user_agents.py").write_text(textwrap.dedent(USER_AGENTS))
    (tmp_path / "agent_program.py").write_text(textwrap.dedent(AGENT_PROGRAM))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def kinds(tmp_path):
    program = {"command": [sys.executable, str(tmp_path / "agent_program.py")], "timeout_s": 120}
    return {
        "subclass": ("user_agents:DigitsOnly", {}),
        "episode_function": ("user_agents:ask_twice", {}),
        "separate_process": ("areal_agents.agents.proxy:CommandAgent", program),
    }


def masked_runs(traj):
    runs, current = [], []
    for token, m in zip(traj.input_ids, traj.loss_mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("kind", ["subclass", "episode_function", SEPARATE_PROCESS])
def test_loss_mask_and_logprobs_are_exact(kind, user_code, tiny_dir, tokenizer):
    spec, kwargs = kinds(user_code)[kind]
    engine = HFEngine(load_model(tiny_dir), seed=3)
    agent = make_agent(spec, engine, tokenizer, SamplingParams(max_new_tokens=6), kwargs=kwargs)
    pool = LocalEnvPool("inline")

    async def episode():
        try:
            env = pool.make("areal_agents/Arithmetic-v0", digits=1, max_turns=2)
            return await agent.run_episode(env, seed=5, episode_id="ep0")
        finally:
            if hasattr(agent, "aclose"):
                await agent.aclose()
            await engine.aclose()

    trajectories = asyncio.run(episode())
    assert trajectories, "the episode produced no trajectory"
    fresh = load_model(tiny_dir)
    for traj in trajectories:
        # (1) masked tokens are exactly the model's replies: one run per reply, decoding to its text
        replies = [m["content"] for m in traj.metadata["messages"] if m["role"] == "assistant"]
        runs = masked_runs(traj)
        assert len(runs) == len(replies) >= (2 if kind != "subclass" else 1)
        for run, reply in zip(runs, replies):
            assert run[-1] == tokenizer.eos_token_id or len(run) == 6 or len(run) == 4
            assert tokenizer.decode(run, skip_special_tokens=True) == reply
        unmasked = tokenizer.decode([t for t, m in zip(traj.input_ids, traj.loss_mask) if not m])
        assert ("Q: " in unmasked) == (kind == "subclass")
        # (2) behavior logprobs equal a fresh forward pass of the same weights (version 0)
        (mb,) = make_micro_batches([traj], 4096)
        with torch.no_grad():
            ref = token_logprobs(fresh, mb, temperature=1.0)[0]
        mask = mb.loss_mask[0].bool()
        assert torch.allclose(mb.logprobs[0][mask], ref[mask], atol=1e-4)
        assert set(traj.versions[i] for i in mask.nonzero().flatten().tolist()) == {0}


@pytest.mark.parametrize("kind", ["subclass", "episode_function", SEPARATE_PROCESS])
def test_two_training_steps(kind, user_code, tiny_dir):
    spec, kwargs = kinds(user_code)[kind]
    run = user_code / f"rl_{kind}"
    config = user_code / f"{kind}.yaml"
    config.write_text(
        textwrap.dedent(f"""\
            run_dir: {run}
            model: {{path: {tiny_dir}}}
            steps: 2
            env: {{id: areal_agents/Arithmetic-v0, kwargs: {{digits: 1, max_turns: 2}}}}
            eval: {{num_problems: 4, env_kwargs: {{split: test}}}}
            rollout:
              batch_size: 2
              group_size: 2
              max_new_tokens: 4
              agent: {spec}
              agent_kwargs: {json.dumps(kwargs)}
            ppo: {{filter_zero_variance_groups: false}}
            """)
    )
    assert main(["train", str(config), "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 2
    assert summary["episodes"]["accepted"] == 8 and summary["episodes"]["failed"] == 0
