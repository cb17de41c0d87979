"""Episode functions as agents: any ``async def run(client, task) -> reward`` trains unchanged.

The framework hands the function a capturing OpenAI-style client (`ChatCapture`) and the episode's
`Task` (the env's first observation, its info, and ``task.step`` to score an answer with the env),
then collects every token the client served. The reward is the function's return value; if it returns
None, the sum of the env rewards from ``task.step`` (and of per-call rewards set on ``task``).

    async def solve(client, task):
        messages = [{"role": "user", "content": task.prompt}]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        _, reward, *_ = await task.step(reply.choices[0].message.content)
        return reward
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from areal_agents.agents.capture import CapturingAgent, ChatCapture
from areal_agents.engines.base import InferenceEngine
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.types import SamplingParams, Trajectory

EpisodeFunction = Callable[[Any, "Task"], Awaitable[float | None]]


@dataclass
class Task:
    """What an episode function works on: the env's reset, and the env itself for scoring."""

    prompt: str
    info: dict[str, Any]
    env: AsyncEnv
    capture: ChatCapture
    env_rewards: list[float] = field(default_factory=list)

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Step the env with ``action`` (e.g. the final answer); its reward counts toward the episode's."""
        result = await self.env.astep(action)
        self.env_rewards.append(float(result[1]))
        return result

    def set_reward(self, reward: float, completion_id: str | None = None) -> None:
        """Set the episode's reward, or one call's (by its ``ChatCompletion.id``)."""
        self.capture.set_reward(reward, completion_id)


class EpisodeFunctionAgent(CapturingAgent):
    """Wraps an episode function as an `Agent` (``rollout.agent: my_module:solve`` does this for you)."""

    def __init__(
        self,
        fn: EpisodeFunction,
        engine: InferenceEngine,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingParams,
        *,
        agent_id: str = "agent",
        max_total_tokens: int = 4096,
    ) -> None:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"an episode function must be `async def name(client, task)`, got {fn!r}")
        super().__init__(engine, tokenizer, sampling, agent_id=agent_id, max_total_tokens=max_total_tokens)
        self.fn = fn

    async def run_episode(self, env: AsyncEnv, *, seed: int | None, episode_id: str) -> list[Trajectory]:
        capture = self.new_capture(episode_id)
        try:
            prompt, info = await env.areset(seed=seed)
            task = Task(prompt, info, env, capture)
            returned = await self.fn(capture.client, task)
        finally:
            await env.aclose()
        if returned is not None:
            capture.set_reward(float(returned))
        elif task.env_rewards:
            capture.set_reward(sum(task.env_rewards) + sum(capture.call_rewards.values()))
        trajectories = capture.trajectories()
        for t in trajectories:
            t.metadata["env_rewards"] = list(task.env_rewards)
        return trajectories
