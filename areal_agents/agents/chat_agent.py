"""`ChatAgent`: a multi-turn chat policy, token-in/token-out, that builds training trajectories."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from areal_agents.agents.chat_tokens import ChatTokens
from areal_agents.engines.base import InferenceEngine
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.types import GenRequest, SamplingParams, StopReason, Trajectory


class ChatAgent:
    """Talk to an env turn by turn: observation -> chat template -> engine -> action text.

    The conversation is kept as token ids; the loss mask covers exactly the generated tokens.

        agent = ChatAgent(engine, tokenizer, SamplingParams(max_new_tokens=16))
        trajectories = await agent.run_episode(LocalEnvPool("inline").make(env_id), seed=0, episode_id="ep0")

    Subclass and override a hook to change the logic without touching the loop: `format_observation`
    (what the model reads), `parse_action` (what the env receives), `should_stop` (end early), and
    `respond` (answer a turn without stepping the env, as `ToolAgent` does for tool calls).
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

    def format_observation(self, observation: str, info: dict[str, Any]) -> str:
        """The message text the model reads for an env observation."""
        return observation

    def parse_action(self, text: str) -> str:
        """The action sent to the env for the model's reply ``text``."""
        return text

    def should_stop(self, turn: int, reward: float, info: dict[str, Any]) -> bool:
        """End the episode after ``turn`` (0-based) even though the env goes on."""
        return False

    async def respond(self, text: str) -> tuple[str, str] | None:
        """Answer the model's reply here as ``(role, message)`` instead of stepping the env; None steps it."""
        return None

    async def run_episode(self, env: AsyncEnv, *, seed: int | None, episode_id: str) -> list[Trajectory]:
        try:
            segments, turn_rewards, cut, final_info, stop_reasons = await self._play(env, seed, episode_id)
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
                    "truncated_by_agent": cut is not None,  # out of context or of turns
                    "context_exhausted": cut == "context",  # no room left for another turn
                    "final_info": final_info,  # the env's info of the last step (e.g. the extracted answer)
                    "messages": seg.messages,
                    "stop_reasons": stop_reasons,  # the engine's stop_reason of each generated turn, in order
                },
            )
            for i, seg in enumerate(segments)
            if sum(seg.loss_mask) > 0
        ]

    async def _play(
        self, env: AsyncEnv, seed: int | None, episode_id: str
    ) -> tuple[list[ChatTokens], list[float], str | None, dict[str, Any], list[StopReason]]:
        """The turn loop: the token segments, the reward of each turn, why the agent cut it off (``context``:
        no room for another turn; ``max_turns``; None: the env or `should_stop` ended it), the env's last
        step info, and the engine's stop reason of each generation."""
        observation, info = await env.areset(seed=seed)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": info.get("role", "user"), "content": self.format_observation(observation, info)})
        chat = ChatTokens(self.tokenizer)
        chat.start(messages)
        segments: list[ChatTokens] = []
        turn_rewards: list[float] = []
        cut: str | None = None
        last_info: dict[str, Any] = {}
        stop_reasons: list[StopReason] = []
        limits = getattr(self.engine, "limits", None)  # an in-process engine knows its model's context
        room = min(self.max_total_tokens, getattr(limits, "context", None) or self.max_total_tokens)
        for turn in range(self.max_turns):
            budget = min(self.sampling.max_new_tokens, room - len(chat.input_ids))
            if budget < 1:
                cut = "context"
                break
            request = GenRequest(
                f"{episode_id}/t{turn}", list(chat.input_ids), replace(self.sampling, max_new_tokens=budget)
            )
            response = await self.engine.agenerate(request)
            stop_reasons.append(response.stop_reason)
            text = chat.append_generation(response.output_tokens, response.output_logprobs, response.output_versions)
            answered = await self.respond(text)
            if answered is not None:
                role, message = answered
            else:
                observation, reward, terminated, truncated, info = await env.astep(self.parse_action(text))
                turn_rewards.append(float(reward))
                last_info = info
                if terminated or truncated or self.should_stop(turn, float(reward), info):
                    break
                role, message = info.get("role", "user"), self.format_observation(observation, info)
            if not chat.append_message(role, message):
                segments.append(chat)  # the template rewrote history: start a new segment
                chat = ChatTokens(self.tokenizer)
                chat.start([*segments[-1].messages, {"role": role, "content": message}])
        else:
            cut = "max_turns"
        segments.append(chat)
        return segments, turn_rewards, cut, last_info, stop_reasons
