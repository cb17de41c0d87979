"""`ChatAgent`: a multi-turn chat policy, token-in/token-out, that builds training trajectories."""

from __future__ import annotations

from dataclasses import replace

from transformers import PreTrainedTokenizerBase

from areal_agents.agents.chat_tokens import ChatTokens
from areal_agents.engines.base import InferenceEngine
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.types import GenRequest, SamplingParams, Trajectory


class ChatAgent:
    """Talk to an env turn by turn: observation -> chat template -> engine -> action text.

    The conversation is kept as token ids; the loss mask covers exactly the generated tokens.

        agent = ChatAgent(engine, tokenizer, SamplingParams(max_new_tokens=16))
        trajectories = await agent.run_episode(LocalEnvPool("inline").make(env_id), seed=0, episode_id="ep0")
    """

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingParams,
        *,
        system_prompt: str = "",
        agent_id: str = "agent",
        max_turns: int = 32,
        max_total_tokens: int = 4096,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        stop = sorted({*sampling.stop_token_ids, tokenizer.eos_token_id})
        self.sampling = replace(sampling, stop_token_ids=stop)
        self.system_prompt = system_prompt
        self.agent_id = agent_id
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens

    async def run_episode(self, env: AsyncEnv, *, seed: int | None, episode_id: str) -> list[Trajectory]:
        try:
            segments, turn_rewards, truncated_by_agent = await self._play(env, seed, episode_id)
        finally:
            await env.aclose()  # also when the env or the engine failed mid-episode
        total = sum(turn_rewards)
        return [
            Trajectory(
                input_ids=seg.input_ids,
                loss_mask=seg.loss_mask,
                logprobs=seg.logprobs,
                versions=seg.versions,
                reward=total,
                turn_rewards=list(turn_rewards),
                agent_id=self.agent_id,
                episode_id=episode_id,
                metadata={
                    "segment": i,
                    "num_turns": len(turn_rewards),
                    "truncated_by_agent": truncated_by_agent,
                    "messages": seg.messages,
                },
            )
            for i, seg in enumerate(segments)
            if sum(seg.loss_mask) > 0
        ]

    async def _play(
        self, env: AsyncEnv, seed: int | None, episode_id: str
    ) -> tuple[list[ChatTokens], list[float], bool]:
        """The turn loop: returns the token segments, the reward of each turn, and whether the agent cut it off."""
        observation, info = await env.areset(seed=seed)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": info.get("role", "user"), "content": observation})
        chat = ChatTokens(self.tokenizer)
        chat.start(messages)
        segments: list[ChatTokens] = []
        turn_rewards: list[float] = []
        truncated_by_agent = False
        for turn in range(self.max_turns):
            budget = min(self.sampling.max_new_tokens, self.max_total_tokens - len(chat.input_ids))
            if budget < 1:
                truncated_by_agent = True
                break
            request = GenRequest(
                f"{episode_id}/t{turn}", list(chat.input_ids), replace(self.sampling, max_new_tokens=budget)
            )
            response = await self.engine.agenerate(request)
            action = chat.append_generation(response.output_tokens, response.output_logprobs, response.output_versions)
            observation, reward, terminated, truncated, info = await env.astep(action)
            turn_rewards.append(float(reward))
            if terminated or truncated:
                break
            if not chat.append_message(info.get("role", "user"), observation):
                segments.append(chat)  # the template rewrote history: start a new segment
                chat = ChatTokens(self.tokenizer)
                chat.start([*segments[-1].messages, {"role": info.get("role", "user"), "content": observation}])
        else:
            truncated_by_agent = True
        segments.append(chat)
        return segments, turn_rewards, truncated_by_agent
