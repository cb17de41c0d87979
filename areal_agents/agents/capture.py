"""`ChatCapture`: an OpenAI-style chat client backed by our engine that records every token it serves.

Agent code written against ``openai.AsyncOpenAI`` runs unchanged on ``capture.client``
(``client.chat.completions.create(messages=..., tools=...)`` returns the SDK's own ``ChatCompletion``).
Each call is recorded token-in/token-out. A call whose messages extend the previous call's conversation
(its messages, then the reply we returned, then new messages) continues the same token sequence: the
generated tokens stay exactly as sampled and only the new messages are rendered. Any other call (the
agent edited history, or the chat template rewrote it) starts a new trajectory segment.

Sampling temperature and top-p come from the rollout config, whatever the call asks for, so that the
behavior logprobs match what the trainer recomputes; ``max_tokens`` is honoured up to the config's.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from openai.types import CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionMessageToolCall
from openai.types.chat.chat_completion import Choice
from transformers import PreTrainedTokenizerBase

from areal_agents.agents.chat_tokens import ChatTokens
from areal_agents.engines.base import InferenceEngine
from areal_agents.envs.tools import find_tool_calls
from areal_agents.types import GenRequest, SamplingParams, Trajectory


@dataclass
class _Segment:
    chat: ChatTokens
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
    ) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        stop = sorted({*sampling.stop_token_ids, tokenizer.eos_token_id})
        self.sampling = replace(sampling, stop_token_ids=stop)
        self.episode_id, self.agent_id = episode_id, agent_id
        self.max_total_tokens = max_total_tokens
        self.segments: list[_Segment] = []
        self.stop_reasons: list[str] = []  # the engine's stop_reason of each call, in order
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
        calls = [c for s in self.segments for c in s.completion_ids]
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
                },
            )
            for i, s in enumerate(self.segments)
            if sum(s.chat.loss_mask) > 0
        ]

    def _prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> _Segment:
        """The segment this call continues (its prompt tokens appended), or a new one."""
        messages = [_plain(m) for m in messages]
        for segment in reversed(self.segments):  # the newest conversation this call extends, if any
            seen = segment.chat.messages
            if segment.chat.tools == tools and len(messages) > len(seen) and messages[: len(seen)] == seen:
                if segment.chat.append_messages(messages[len(seen) :]):
                    return segment
                break  # the template rewrote history: a new segment
        chat = ChatTokens(self.tokenizer, tools=tools)
        chat.start(messages)
        self.segments.append(_Segment(chat))
        return self.segments[-1]

    async def create(
        self,
        *,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
        max_completion_tokens: int | None = None,
        n: int | None = None,
        **ignored: Any,
    ) -> ChatCompletion:
        """``chat.completions.create``: one choice, sampled with the rollout's temperature and top-p."""
        if n not in (None, 1):
            raise ValueError(f"n: the capturing client samples one choice per call, got n={n}")
        if not messages:
            raise ValueError("messages: expects at least one message")
        segment = self._prompt(messages, tools)
        chat = segment.chat
        budget = min(
            self.sampling.max_new_tokens,
            max_completion_tokens or max_tokens or self.sampling.max_new_tokens,
            self.max_total_tokens - len(chat.input_ids),
        )
        if budget < 1:
            raise ValueError(f"the conversation is {len(chat.input_ids)} tokens: no room under max_total_tokens")
        prompt_tokens = len(chat.input_ids)
        k = next(self._calls)
        request = GenRequest(
            f"{self.episode_id}/c{k}", list(chat.input_ids), replace(self.sampling, max_new_tokens=budget)
        )
        response = await self.engine.agenerate(request)
        self.stop_reasons.append(response.stop_reason)
        text = chat.append_generation(response.output_tokens, response.output_logprobs, response.output_versions)
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        message = _reply(text, tools, completion_id)
        chat.messages[-1] = _plain(message.model_dump(exclude_none=True))  # as the agent will send it back
        segment.completion_ids.append(completion_id)
        finish = "tool_calls" if message.tool_calls else ("length" if response.stop_reason == "length" else "stop")
        n_out = len(response.output_tokens)
        return ChatCompletion(
            id=completion_id,
            object="chat.completion",
            created=int(time.time()),
            model="areal-agents-policy",
            choices=[Choice(index=0, message=message, finish_reason=finish)],
            usage=CompletionUsage(
                prompt_tokens=prompt_tokens, completion_tokens=n_out, total_tokens=prompt_tokens + n_out
            ),
        )


class CapturingAgent:
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


def _reply(text: str, tools: list[dict[str, Any]] | None, completion_id: str) -> ChatCompletionMessage:
    """The assistant message; with ``tools``, ``<tool_call>`` blocks become OpenAI ``tool_calls``."""
    calls = []
    if tools:
        for k, raw in enumerate(find_tool_calls(text)):
            try:
                call = json.loads(raw)
                name, arguments = str(call["name"]), call.get("arguments", {})
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # not a well-formed call: it stays in the text, as the model wrote it
            args = arguments if isinstance(arguments, str) else json.dumps(arguments)
            calls.append(
                ChatCompletionMessageToolCall(
                    id=f"call_{completion_id[-8:]}_{k}", type="function", function={"name": name, "arguments": args}
                )
            )
    return ChatCompletionMessage(role="assistant", content=text, tool_calls=calls or None)


def _plain(message: Any) -> dict[str, Any]:
    """A message as a plain dict with the keys that matter for comparing conversations."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    out = {"role": message["role"], "content": message.get("content") or ""}
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


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
