"""`ChatAgent`: a multi-turn chat policy, token-in/token-out, that builds training trajectories."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from areal_agents.agents.base import Agent
from areal_agents.agents.chat_tokens import ChatTokens
from areal_agents.chat.parsers import ReplyParser
from areal_agents.chat.replies import ParsedReply
from areal_agents.engines.base import InferenceEngine
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.models.families import stop_token_ids
from areal_agents.types import GenRequest, SamplingParams, StopReason, Trajectory


class ChatAgent(Agent):
    """Talk to an env turn by turn: observation -> chat template -> engine -> action text.

    The conversation is kept as token ids; the loss mask covers exactly the generated tokens.

        agent = ChatAgent(engine, tokenizer, SamplingParams(max_new_tokens=16))
        trajectories = await agent.run_episode(LocalEnvPool("inline").make(env_id), seed=0, episode_id="ep0")

    Subclass and override a hook to change the logic without touching the loop: `format_observation`
    (what the model reads), `parse_action` (what the env receives), `should_stop` (end early), and
    `respond` (answer a turn without stepping the env), `answer` (the same, from the parsed reply: `ToolAgent`
    answers tool calls there).

    Replies are parsed by the tokenizer's template's `ReplyParser` (``tool_parser``/``reasoning_parser``
    override it); each episode's trajectories count its tool calls and malformed calls in their metadata.
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
        tool_parser: str = "auto",
        reasoning_parser: str = "auto",
        chat_template_kwargs: dict[str, Any] | None = None,
        keep_reasoning: bool = False,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.parser = ReplyParser.for_template(tokenizer.chat_template, tool_parser, reasoning_parser)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.keep_reasoning = keep_reasoning
        self.tool_schemas: list[dict[str, Any]] | None = None  # tools the chat template lists (`ToolAgent`'s)
        stop = sorted({*sampling.stop_token_ids, *stop_token_ids(tokenizer)})
        self.sampling = replace(sampling, stop_token_ids=stop)
        self.system_prompt = system_prompt
        self.agent_id = agent_id
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens

    def format_observation(self, observation: str, info: dict[str, Any]) -> str:
        """The message text the model reads for an env observation."""
        return observation

    def parse_action(self, text: str) -> str:
        """The action sent to the env for the model's reply ``text`` (its reasoning taken out)."""
        return text

    def should_stop(self, turn: int, reward: float, info: dict[str, Any]) -> bool:
        """End the episode after ``turn`` (0-based) even though the env goes on."""
        return False

    async def respond(self, text: str) -> tuple[str, str] | None:
        """Answer the model's reply here as ``(role, message)`` instead of stepping the env; None steps it."""
        return None

    async def answer(self, reply: ParsedReply, text: str) -> list[dict[str, Any]] | None:
        """Answer the parsed reply here as chat messages instead of stepping the env; None steps it.
        By default `respond`'s answer."""
        answered = await self.respond(text)
        return None if answered is None else [{"role": answered[0], "content": answered[1]}]

    def new_chat(self) -> ChatTokens:
        """An empty conversation rendered as this agent renders (its parser and template kwargs)."""
        return ChatTokens(
            self.tokenizer,
            tools=self.tool_schemas,
            template_kwargs=self.chat_template_kwargs,
            parser=self.parser,
            keep_reasoning=self.keep_reasoning,
        )

    async def run_episode(self, env: AsyncEnv, *, seed: int | None, episode_id: str) -> list[Trajectory]:
        try:
            play = await self._play(env, seed, episode_id)
        finally:
            await env.aclose()  # also when the env or the engine failed mid-episode
        total = sum(play.turn_rewards)
        return [
            Trajectory(
                input_ids=seg.input_ids,
                loss_mask=seg.loss_mask,
                logprobs=seg.logprobs,
                versions=seg.versions,
                reward=total,
                turn_rewards=list(play.turn_rewards),
                agent_id=self.agent_id,
                episode_id=episode_id,
                metadata={
                    "segment": i,
                    "num_segments": sum(1 for s in play.segments if sum(s.loss_mask) > 0),  # the trajectories
                    "num_turns": len(play.turn_rewards),
                    "truncated_by_agent": play.cut is not None,  # out of context or of turns
                    "context_exhausted": play.cut == "context",  # no room left for another turn
                    "final_info": play.last_info,  # the env's info of the last step (e.g. the extracted answer)
                    "messages": seg.messages,
                    "stop_reasons": play.stop_reasons,  # the engine's stop_reason of each generated turn, in order
                    "tool_calls": play.tool_calls,  # well-formed calls the parser found in the episode's replies
                    "tool_parse_failures": play.tool_parse_failures,  # malformed calls (each answered as an error)
                },
            )
            for i, seg in enumerate(play.segments)
            if sum(seg.loss_mask) > 0
        ]

    async def _play(self, env: AsyncEnv, seed: int | None, episode_id: str) -> _Play:
        """The turn loop: generate, parse, answer (tools) or step the env, append what comes back."""
        observation, info = await env.areset(seed=seed)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": info.get("role", "user"), "content": self.format_observation(observation, info)})
        chat = self.new_chat()
        chat.start(messages)
        play = _Play()
        room = min(self.max_total_tokens, self.engine.max_context() or self.max_total_tokens)  # a known context
        for turn in range(self.max_turns):
            budget = min(self.sampling.max_new_tokens, room - len(chat.input_ids))
            if budget < 1:
                play.cut = "context"
                break
            request = GenRequest(
                f"{episode_id}/t{turn}", list(chat.input_ids), replace(self.sampling, max_new_tokens=budget)
            )
            response = await self.engine.agenerate(request)
            play.stop_reasons.append(response.stop_reason)
            text = chat.append_generation(response.output_tokens, response.output_logprobs, response.output_versions)
            reply = chat.last_reply
            play.tool_calls += len(reply.tool_calls)
            play.tool_parse_failures += len(reply.errors)
            answered = await self.answer(reply, text)
            if answered is None:
                observation, reward, terminated, truncated, info = await env.astep(self.parse_action(chat.last_answer))
                play.turn_rewards.append(float(reward))
                play.last_info = info
                if terminated or truncated or self.should_stop(turn, float(reward), info):
                    break
                answered = [{"role": info.get("role", "user"), "content": self.format_observation(observation, info)}]
            if not chat.append_messages(answered):
                play.segments.append(chat)  # the template rewrote history: start a new segment
                chat = self.new_chat()
                chat.start([*play.segments[-1].messages, *answered])
        else:
            play.cut = "max_turns"
        play.segments.append(chat)
        return play


@dataclass
class _Play:
    """One episode as played: its token segments, the reward of each env step, why the agent cut it off
    (``context``: no room for another turn; ``max_turns``; None: the env or `should_stop` ended it), the env's
    last step info, the engine's stop reason of each generation, and the parsed tool calls and failures."""

    segments: list[ChatTokens] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    cut: str | None = None
    last_info: dict[str, Any] = field(default_factory=dict)
    stop_reasons: list[StopReason] = field(default_factory=list)
    tool_calls: int = 0
    tool_parse_failures: int = 0
