"""`ChatCapture`: an OpenAI-style chat client backed by our engine that records every token it serves.

Agent code written against ``openai.AsyncOpenAI`` runs unchanged on ``capture.client``
(``client.chat.completions.create(messages=..., tools=...)`` returns the SDK's own ``ChatCompletion``).
Each call is recorded token-in/token-out. A call whose messages extend the previous call's conversation
(its messages, then the reply we returned, then new messages) continues the same token sequence: the
generated tokens stay exactly as sampled and only the new messages are rendered. Any other call (the
agent edited history, or the chat template rewrote it) starts a new trajectory segment.

Replies have serve-model's ``/v1/chat/completions`` shapes (``openai_shapes``): ``reasoning_content`` and
``tool_calls`` from the template's `ReplyParser` (a malformed call stays in ``content``, never dropped),
``stop`` strings (the tokens up to the stop string are recorded, what the engine sampled after it is not;
the choice's non-standard ``stop_reason`` names it, as vLLM's does),
``logprobs``, and ``n``: each choice is its own branch, a segment of its own whose earlier turns are prompt
(trained once, in the branch they came from), so the agent may continue from any of them.

Sampling temperature and top-p come from the rollout config, whatever the call asks for, so that the
behavior logprobs match what the trainer recomputes; ``max_tokens`` is honoured up to the config's.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from openai.types.chat import ChatCompletion
from transformers import PreTrainedTokenizerBase

from areal_agents.agents.base import Agent
from areal_agents.agents.chat_tokens import ChatTokens
from areal_agents.chat import ReplyParser
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.model_server.openai_shapes import (
    OpenAIRequestError,
    chat_logprobs,
    finish_reason,
    generated,
    plain_message,
    reply_message,
    same_message,
    stop_strings,
    usage,
)
from areal_agents.errors import EngineError
from areal_agents.models.families import stop_token_ids
from areal_agents.types import GenRequest, GenResponse, SamplingParams, Trajectory


@dataclass
class _Segment:
    chat: ChatTokens
    sent: list[dict[str, Any]] = field(default_factory=list)  # the conversation as the client sees it
    completion_ids: list[str] = field(default_factory=list)


class ChatCapture:
    """One episode's capturing client and its records; `trajectories()` turns them into training data.

    capture = ChatCapture(engine, tokenizer, SamplingParams(max_new_tokens=64), episode_id="ep0")
    reply = await capture.client.chat.completions.create(model="policy", messages=[...])
    capture.set_reward(1.0)
    trajectories = capture.trajectories()
    """

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingParams,
        *,
        episode_id: str,
        agent_id: str = "agent",
        max_total_tokens: int = 4096,
        parser: ReplyParser | None = None,
    ) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.parser = parser or ReplyParser.for_template(tokenizer.chat_template)
        self.stop_ids = set(stop_token_ids(tokenizer))
        self.sampling = replace(sampling, stop_token_ids=sorted({*sampling.stop_token_ids, *self.stop_ids}))
        self.episode_id, self.agent_id = episode_id, agent_id
        self.max_total_tokens = max_total_tokens
        self.segments: list[_Segment] = []
        self.stop_reasons: list[str] = []  # the engine's stop_reason of each call, in order
        self.tool_calls, self.tool_parse_failures = 0, 0  # over the episode's replies
        self.call_rewards: dict[str, float] = {}  # completion id -> reward
        self.episode_reward: float | None = None
        self._calls = itertools.count()
        self.client = _Client(self)

    def set_reward(self, reward: float, completion_id: str | None = None) -> None:
        """The episode's reward, or (with ``completion_id``) the reward of one call; both may be used."""
        if completion_id is None:
            self.episode_reward = float(reward)
        elif not any(completion_id in s.completion_ids for s in self.segments):
            raise KeyError(f"set_reward: no call of this episode has completion id {completion_id!r}")
        else:
            self.call_rewards[completion_id] = float(reward)

    @property
    def reward(self) -> float:
        """The episode reward if set, else the sum of the per-call rewards."""
        return self.episode_reward if self.episode_reward is not None else sum(self.call_rewards.values())

    def trajectories(self) -> list[Trajectory]:
        """One trajectory per segment that holds generated tokens, sharing the episode's reward."""
        calls = list(dict.fromkeys(c for s in self.segments for c in s.completion_ids))  # n > 1: one id, n branches
        turn_rewards = [self.call_rewards.get(c, 0.0) for c in calls]
        return [
            Trajectory(
                input_ids=s.chat.input_ids,
                loss_mask=s.chat.loss_mask,
                logprobs=s.chat.logprobs,
                versions=s.chat.versions,
                reward=self.reward,
                turn_rewards=turn_rewards,
                agent_id=self.agent_id,
                episode_id=self.episode_id,
                metadata={
                    "segment": i,
                    "num_turns": len(calls),
                    "messages": s.chat.messages,
                    "stop_reasons": list(self.stop_reasons),
                    "num_segments": len(self.segments),
                    "tool_calls": self.tool_calls,  # well-formed calls in the replies (with tools given)
                    "tool_parse_failures": self.tool_parse_failures,  # malformed ones
                },
            )
            for i, s in enumerate(self.segments)
            if sum(s.chat.loss_mask) > 0
        ]

    def _prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None
    ) -> _Segment:
        """The segment this call continues (its prompt tokens appended), or a new one."""
        for segment in reversed(self.segments):  # the newest conversation this call extends, if any
            seen, chat = segment.sent, segment.chat
            same_call = chat.tools == tools and (chat.template_kwargs or None) == (kwargs or None)
            if same_call and len(messages) > len(seen) and all(map(same_message, messages, seen)):
                if chat.append_messages(messages[len(seen) :]):
                    segment.sent = list(messages)
                    return segment
                break  # the template rewrote history: a new segment
        chat = ChatTokens(self.tokenizer, tools=tools, template_kwargs=kwargs, parser=self.parser)
        chat.start(messages)
        self.segments.append(_Segment(chat, list(messages)))
        return self.segments[-1]

    def _branch(self, segment: _Segment) -> _Segment:
        """A copy of ``segment`` before its generation, for another choice of the same call: its earlier
        turns are prompt there (they are trained in ``segment``)."""
        chat = copy.copy(segment.chat)
        chat.messages = list(chat.messages)
        chat.input_ids = list(chat.input_ids)
        chat.loss_mask = [0] * len(chat.input_ids)
        chat.logprobs = [0.0] * len(chat.input_ids)
        chat.versions = [-1] * len(chat.input_ids)
        self.segments.append(_Segment(chat, list(segment.sent)))
        return self.segments[-1]

    async def create(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
        max_completion_tokens: int | None = None,
        n: int | None = None,
        stop: str | list[str] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        tool_choice: Any = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        stream: bool | None = None,
        **ignored: Any,
    ) -> ChatCompletion:
        """``chat.completions.create``: ``n`` choices sampled with the rollout's temperature and top-p.
        `OpenAIRequestError` (a ValueError) names a field it cannot honour."""
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise OpenAIRequestError("n", f"expects an integer >= 1, got {n!r}")
        if top_logprobs:
            raise OpenAIRequestError("top_logprobs", "the engine gives the chosen tokens' logprobs only: use 0")
        if stream:
            raise OpenAIRequestError("stream", "the capturing client answers whole completions only (stream=false)")
        if tool_choice not in (None, "auto", "none"):
            raise OpenAIRequestError("tool_choice", f"calls are not forced: 'auto' or 'none', got {tool_choice!r}")
        if not messages:
            raise OpenAIRequestError("messages", "expects at least one message")
        stops = stop_strings(stop)
        sent = [plain_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
        segment = self._prompt(sent, tools or None, chat_template_kwargs)
        prompt = list(segment.chat.input_ids)
        budget = min(
            self.sampling.max_new_tokens,
            max_completion_tokens or max_tokens or self.sampling.max_new_tokens,
            self.max_total_tokens - len(prompt),
        )
        if budget < 1:
            raise OpenAIRequestError(
                "messages", f"the conversation is {len(prompt)} tokens: no room under max_total_tokens"
            )
        branches = [segment] + [self._branch(segment) for _ in range(n - 1)]
        k = next(self._calls)
        sampling = replace(self.sampling, max_new_tokens=budget)
        responses = await asyncio.gather(
            *(self.engine.agenerate(GenRequest(f"{self.episode_id}/c{k}/{i}", prompt, sampling)) for i in range(n))
        )
        if any(r.stop_reason == "abort" for r in responses):  # the engine is stopping: no reply to give
            raise EngineError(f"the engine aborted call {k} of {self.episode_id} (stopping or cancelled)")
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        parse_tools = bool(tools) and tool_choice != "none"
        choices = [
            self._record(branch, response, i, completion_id, stops, parse_tools, bool(logprobs))
            for i, (branch, response) in enumerate(zip(branches, responses))
        ]
        n_out = sum(len(c.pop("_tokens")) for c in choices)
        return ChatCompletion.model_validate(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": "areal-agents-policy",
                "choices": choices,
                "usage": usage(len(prompt), n_out),
            }
        )

    def _record(
        self,
        segment: _Segment,
        response: GenResponse,
        index: int,
        completion_id: str,
        stops: list[str],
        parse_tools: bool,
        with_logprobs: bool,
    ) -> dict[str, Any]:
        """Append one choice's tokens (up to a stop string) to ``segment``; its ``choices[index]`` object."""
        self.stop_reasons.append(response.stop_reason)
        tokens, lps = response.output_tokens, response.output_logprobs
        gen = generated(self.tokenizer, tokens, lps, response.stop_reason, stops, self.stop_ids)
        segment.chat.append_generation(gen.tokens, gen.logprobs, response.output_versions[: len(gen.tokens)])
        message, errors = reply_message(self.parser, gen.text, parse_tools)
        self.tool_calls += len(message.get("tool_calls") or [])
        self.tool_parse_failures += len(errors)
        segment.sent.append(plain_message(message))  # as the agent will send it back
        segment.completion_ids.append(completion_id)
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(self.tokenizer, gen.tokens, gen.logprobs) if with_logprobs else None,
            "finish_reason": finish_reason(message, gen.finish),
            "_tokens": gen.tokens,
        }
        if errors:
            choice["tool_call_errors"] = errors  # non-standard: the malformed calls, which stay in content
        if gen.stop is not None:
            choice["stop_reason"] = gen.stop  # non-standard, as vLLM's: the stop string that ended the reply
        return choice


class CapturingAgent(Agent):
    """Base of agents whose episodes run on a fresh `ChatCapture` (episode functions, agent programs)."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingParams,
        *,
        agent_id: str = "agent",
        max_total_tokens: int = 4096,
    ) -> None:
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.agent_id, self.max_total_tokens = agent_id, max_total_tokens

    def new_capture(self, episode_id: str) -> ChatCapture:
        return ChatCapture(
            self.engine,
            self.tokenizer,
            self.sampling,
            episode_id=episode_id,
            agent_id=self.agent_id,
            max_total_tokens=self.max_total_tokens,
        )


class _Completions:
    def __init__(self, capture: ChatCapture) -> None:
        self.create = capture.create


class _Chat:
    def __init__(self, capture: ChatCapture) -> None:
        self.completions = _Completions(capture)


class _Client:
    """The ``client.chat.completions.create`` surface of ``openai.AsyncOpenAI``."""

    def __init__(self, capture: ChatCapture) -> None:
        self.chat = _Chat(capture)
