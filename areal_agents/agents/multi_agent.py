"""`MultiAgentChatAgent`: plays every agent of a `MultiAgentTextEnv` episode, one trajectory per agent.

Each agent id keeps its own conversation as token ids (`ChatTokens`): its own generations are its loss
tokens, and what the env shows it (the task, other agents' answers) arrives as observations, never in
its loss mask. Agent ids map to policies: one shared engine (all agents' turns train one model) or an
engine per agent id (separate policies). Agents acting in the same step generate concurrently.

Who acts is the env's call: ``env.acting`` after each reset and step (a turn-based env names one agent at a
time; [] ends the episode). An observation to an agent that is not acting waits in its chat's queue and
joins its conversation before it next generates. An env without ``acting`` (None) is parallel: every agent
that got an observation and has not terminated acts.

    agent = MultiAgentChatAgent({"debater_0": engine_a, "debater_1": engine_b}, tokenizer, sampling)
    trajectories = await agent.run_episode(pool.make("areal_agents/Debate-v0"), seed=0, episode_id="ep0")
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from areal_agents.agents.base import Agent
from areal_agents.agents.chat_tokens import ChatTokens
from areal_agents.engines.base import InferenceEngine
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.errors import ArealAgentsError
from areal_agents.models.families import stop_token_ids
from areal_agents.types import GenRequest, SamplingParams, StopReason, Trajectory


class MultiAgentChatAgent(Agent):
    """``engine``: one engine for every agent id (a shared policy) or a mapping agent id -> engine."""

    def __init__(
        self,
        engine: InferenceEngine | Mapping[str, InferenceEngine],
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingParams,
        *,
        system_prompt: str = "",
        system_prompts: Mapping[str, str] | None = None,
        max_turns: int = 32,
        max_total_tokens: int = 4096,
    ) -> None:
        self.engines = engine if isinstance(engine, Mapping) else None
        self.engine = None if isinstance(engine, Mapping) else engine
        self.tokenizer = tokenizer
        stop = sorted({*sampling.stop_token_ids, *stop_token_ids(tokenizer)})
        self.sampling = replace(sampling, stop_token_ids=stop)
        self.system_prompt, self.system_prompts = system_prompt, dict(system_prompts or {})
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens

    def engine_for(self, agent_id: str) -> InferenceEngine:
        if self.engines is None:
            return self.engine
        if agent_id not in self.engines:
            raise ArealAgentsError(f"no policy for agent id {agent_id!r}; policies: {sorted(self.engines)}")
        return self.engines[agent_id]

    async def run_episode(self, env: AsyncEnv, *, seed: int | None, episode_id: str) -> list[Trajectory]:
        try:
            segments, turn_rewards, final_info, stop_reasons, cut = await self._play(env, seed, episode_id)
        finally:
            await env.aclose()
        out = []
        for agent_id, chats in segments.items():
            info = final_info.get(agent_id, {})
            outcome = {"success": bool(info["success"])} if "success" in info else {}
            for i, chat in enumerate(chats):
                if sum(chat.loss_mask) == 0:
                    continue
                out.append(
                    Trajectory(
                        input_ids=chat.input_ids,
                        loss_mask=chat.loss_mask,
                        logprobs=chat.logprobs,
                        versions=chat.versions,
                        reward=sum(turn_rewards[agent_id]),
                        turn_rewards=list(turn_rewards[agent_id]),
                        agent_id=agent_id,
                        episode_id=f"{episode_id}/{agent_id}",
                        metadata={
                            "segment": i,
                            "num_segments": sum(1 for c in chats if sum(c.loss_mask) > 0),  # this agent's
                            "num_turns": len(turn_rewards[agent_id]),
                            "messages": chat.messages,
                            "episode": episode_id,
                            "info": info,
                            "stop_reasons": list(stop_reasons[agent_id]),  # the engine's, of each of its turns
                            "context_exhausted": agent_id in cut,  # cut: a conversation had no room left
                            **outcome,
                        },
                    )
                )
        return out

    async def _play(self, env: AsyncEnv, seed: int | None, episode_id: str):
        observations, infos = await env.areset(seed=seed)
        pending: dict[str, list[dict[str, Any]]] = defaultdict(list)  # observations not yet in the chat
        chats: dict[str, ChatTokens] = {}
        segments: dict[str, list[ChatTokens]] = defaultdict(list)
        turn_rewards: dict[str, list[float]] = defaultdict(list)
        final_info: dict[str, dict[str, Any]] = {}
        stop_reasons: dict[str, list[StopReason]] = defaultdict(list)
        cut: set[str] = set()  # the agents still acting when a conversation ran out of room
        done: set[str] = set()
        self._queue(pending, observations, infos, done)
        acting = env.acting if env.acting is not None else list(observations)
        for turn in range(self.max_turns):
            if not acting:
                break
            for a in acting:
                self._catch_up(a, chats, segments, pending)
            budgets = {
                a: min(self.sampling.max_new_tokens, self.max_total_tokens - len(chats[a].input_ids)) for a in acting
            }
            if min(budgets.values()) < 1:
                cut = set(acting)
                break  # a conversation outgrew max_total_tokens: the agent cuts the episode
            responses = await asyncio.gather(
                *(
                    self.engine_for(a).agenerate(
                        GenRequest(
                            f"{episode_id}/{a}/t{turn}",
                            list(chats[a].input_ids),
                            replace(self.sampling, max_new_tokens=budgets[a]),
                        )
                    )
                    for a in acting
                )
            )
            for a, r in zip(acting, responses):
                stop_reasons[a].append(r.stop_reason)
            actions = {
                a: chats[a].append_generation(r.output_tokens, r.output_logprobs, r.output_versions)
                for a, r in zip(acting, responses)
            }
            observations, rewards, terminations, truncations, infos = await env.astep(actions)
            for a in acting:
                turn_rewards[a].append(float(rewards.get(a, 0.0)))
            for a, r in rewards.items():  # a reward to an agent that did not act: its last turn's
                if a not in acting and turn_rewards[a]:
                    turn_rewards[a][-1] += float(r)
            for a in {*terminations, *truncations}:
                if terminations.get(a) or truncations.get(a):
                    final_info[a] = infos.get(a, {})
                    done.add(a)
            self._queue(pending, observations, infos, done)
            acting = env.acting if env.acting is not None else [a for a in acting if a not in done]
        for a, chat in chats.items():
            segments[a].append(chat)
        return segments, turn_rewards, final_info, stop_reasons, cut

    @staticmethod
    def _queue(pending: dict[str, list], observations: dict[str, str], infos: dict[str, Any], done: set[str]) -> None:
        for a, observation in observations.items():
            if a not in done:
                pending[a].append({"role": infos.get(a, {}).get("role", "user"), "content": observation})

    def _catch_up(self, a: str, chats: dict[str, ChatTokens], segments: dict, pending: dict[str, list]) -> None:
        """Agent ``a``'s chat with every observation it got since it last generated, ready to generate."""
        messages, pending[a] = pending[a], []
        if a not in chats:
            prompt = self.system_prompts.get(a, self.system_prompt)
            chats[a] = ChatTokens(self.tokenizer)
            chats[a].start([*([{"role": "system", "content": prompt}] if prompt else []), *messages])
        elif not chats[a].append_messages(messages):
            segments[a].append(chats[a])  # the template rewrote history: a new segment
            chats[a] = ChatTokens(self.tokenizer)
            chats[a].start([*segments[a][-1].messages, *messages])
