"""`ChatTokens`: a conversation kept as token ids, grown by appending, never re-tokenizing generations.

Prompts and env observations are rendered with the tokenizer's chat template; generated tokens are
appended exactly as the engine produced them. Each generated turn is parsed (reasoning, tool calls) by the
template's `ReplyParser` and recorded as the OpenAI assistant message the template expects back. To append
messages after a generated turn, the whole conversation is rendered and tokenized again (as a server would for
the next call), and must extend the tokens so far exactly: then only the new tokens are added. When it does not
(the template rewrites history: Qwen3 drops earlier reasoning, Mistral moves the system prompt; or it renders
the sampled turn otherwise than the model wrote it), `append_messages` reports it and the caller starts a new
trajectory segment, never a silent drift; with ``keep_reasoning`` the sampled turns are kept as they are and
only the new messages are rendered, so the episode stays one trajectory.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from areal_agents.chat.parsers import ReplyParser
from areal_agents.chat.replies import ParsedReply
from areal_agents.chat.template_messages import template_message, template_reads
from areal_agents.models.families import stop_token_ids

_MARK = "\x00areal-agents-turn\x00"  # stands in for a turn's content to find where the template ends it


@functools.lru_cache(maxsize=4096)
def _encode_cached(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[int, ...]:
    """The episodes of a group share their prompt: tokenize each rendered text once."""
    return tuple(tokenizer.encode(text, add_special_tokens=False))


@functools.lru_cache(maxsize=4096)
def _render_cached(tokenizer: PreTrainedTokenizerBase, key: str) -> str:
    """The episodes of a group start from the same messages: render the chat template once.
    ``key`` is the JSON of ``[messages, tools, add_generation_prompt, template_kwargs]`` (key order kept)."""
    messages, tools, generation_prompt, kwargs = json.loads(key)
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
    )


@functools.lru_cache(maxsize=64)
def _parser_for(tokenizer: PreTrainedTokenizerBase) -> ReplyParser:
    return ReplyParser.for_template(tokenizer.chat_template)


@dataclass
class ChatTokens:
    tokenizer: PreTrainedTokenizerBase
    messages: list[dict[str, Any]] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # OpenAI-style tool schemas, passed to the chat template
    template_kwargs: dict[str, Any] | None = None  # chat_template_kwargs, e.g. Qwen3's enable_thinking
    parser: ReplyParser | None = None  # None: the one the tokenizer's template implies
    keep_reasoning: bool = False  # on a history rewrite, keep the sampled turns and render only the new messages
    last_reply: ParsedReply | None = None  # the last generated turn, parsed
    last_answer: str = ""  # the last generated turn's text without its reasoning

    def __post_init__(self) -> None:
        if self.parser is None:
            self.parser = _parser_for(self.tokenizer)
        self.stop_ids = stop_token_ids(self.tokenizer)

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool, cache: bool = False) -> str:
        """The template's render; ``cache`` for texts that repeat (a group's shared first prompt), not for a
        whole conversation, which one episode renders once."""
        template = self.tokenizer.chat_template
        messages = [template_message(template, m) if m["role"] == "assistant" else m for m in messages]
        messages = [m if m.get("content") is not None else {**m, "content": ""} for m in messages]
        kwargs = self.template_kwargs or {}
        if cache:
            try:
                return _render_cached(self.tokenizer, json.dumps([messages, self.tools, generation_prompt, kwargs]))
            except TypeError:  # content that is not plain JSON: render it directly
                pass
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def _encode(self, text: str) -> list[int]:
        return list(_encode_cached(self.tokenizer, text))

    def _extend_prompt(self, ids: list[int]) -> None:
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def start(self, messages: list[dict[str, Any]]) -> None:
        """Begin (or restart as a new segment) with the full render of ``messages`` + generation prompt."""
        self.messages = list(messages)
        self.input_ids, self.loss_mask, self.logprobs, self.versions = [], [], [], []
        self._extend_prompt(self._encode(self._render(self.messages, generation_prompt=True, cache=True)))

    def append_generation(self, tokens: list[int], logprobs: list[float], versions: list[int]) -> str:
        """Append the policy's tokens (loss tokens), parse them into ``last_reply`` (and ``last_answer``) and
        record the assistant message; return the turn's text (special tokens left out)."""
        opened = self._opened_reasoning()
        self.input_ids += tokens
        self.loss_mask += [1] * len(tokens)
        self.logprobs += logprobs
        self.versions += versions
        body = tokens[:-1] if tokens and tokens[-1] in self.stop_ids else tokens
        raw = opened + self.tokenizer.decode(body, skip_special_tokens=False)
        self.last_reply = self.parser.parse(raw)
        self.messages.append(self.assistant_message(self.last_reply, raw))
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        if self.last_reply.reasoning is None:
            self.last_answer = text
        else:  # the reply without its reasoning: what an env should read (calls left in, for a ToolEnv)
            self.last_answer = ReplyParser("none", self.parser.reasoning_parser).parse(raw).content
        return text

    def _opened_reasoning(self) -> str:
        """The ``<think>`` a generation prompt opens (QwQ's, DeepSeek-R1's): part of the turn as written. The
        prompt's last tokens are the generation prompt's end (read before the turn is appended)."""
        tail = self.tokenizer.decode(self.input_ids[-8:], skip_special_tokens=False)
        at = tail.rfind("<think>")
        return tail[at:] if at >= 0 and "</think>" not in tail[at:] else ""

    def assistant_message(self, reply: ParsedReply, raw: str) -> dict[str, Any]:
        """``reply`` as the message the template renders back: tool calls and reasoning as fields where the
        template reads them, else left in the text as generated (``raw``)."""
        reads = template_reads(self.tokenizer.chat_template)
        reasoning_key = next((k for k in ("reasoning_content", "thinking") if k in reads), None)
        calls = "tool_calls" in reads and bool(reply.tool_calls)
        channels = self.parser.tool_parser == "harmony"  # harmony's channels frame every reply, calls or not
        split = ReplyParser(
            self.parser.tool_parser if calls or channels else "none",
            self.parser.reasoning_parser if reasoning_key else "none",
        )
        message: dict[str, Any] = {
            "role": "assistant",
            "content": split.parse(raw).content if calls or channels or reasoning_key else raw,
        }
        if reasoning_key and reply.reasoning is not None:
            message[reasoning_key] = reply.reasoning
        if calls:
            message["tool_calls"] = [c.to_message() for c in reply.tool_calls]
        return message

    def append_message(self, role: str, content: str) -> bool:
        """Append an env message and the next generation prompt. False if the template rewrote history."""
        return self.append_messages([{"role": role, "content": content}])

    def append_messages(self, messages: list[dict[str, Any]]) -> bool:
        """Append messages after the last generated turn, then the generation prompt: the template's render of
        the whole conversation, which must extend the tokens so far exactly (the sampled ones included).
        False (nothing changed) if it does not (the template rewrote history, or renders the sampled turn
        otherwise than it was generated), so the caller starts a new segment."""
        closing = [] if self.input_ids and self.input_ids[-1] in self.stop_ids else [self.stop_ids[0]]
        ids = self.input_ids + closing  # a turn that hit its length limit is closed as the template closes it
        new_messages = [*self.messages, *messages]
        text = self._render(new_messages, generation_prompt=True)
        rendered = self.tokenizer.encode(text, add_special_tokens=False)  # not cached: one episode's, used once
        if rendered[: len(ids)] == ids and len(rendered) > len(ids):
            added = rendered[len(ids) :]
        elif self.keep_reasoning and (suffix := self._suffix_in_context(new_messages, ids[-1])) is not None:
            added = self._encode(suffix)
        else:
            return False
        self._extend_prompt(closing + added)
        self.messages = new_messages
        return True

    def _suffix_in_context(self, new_messages: list[dict[str, Any]], stop_id: int) -> str | None:
        """What the template renders after the last assistant turn in the new conversation, the earlier turns
        as it would rewrite them left aside (found by rendering that turn with a marker for its content)."""
        last = max(i for i, m in enumerate(new_messages) if m["role"] == "assistant")
        marked = [*new_messages]
        marked[last] = {k: v for k, v in marked[last].items() if k not in ("reasoning_content", "thinking")}
        marked[last]["content"] = _MARK
        text = self._render(marked, generation_prompt=True)
        stop_text = self.tokenizer.decode([stop_id], skip_special_tokens=False)
        at = text.find(_MARK)
        end = text.find(stop_text, at) if at >= 0 else -1
        return None if end < 0 else text[end + len(stop_text) :]
