"""`ChatTokens`: a conversation kept as token ids, grown by appending, never re-tokenizing generations.

Prompts and env observations are rendered with the tokenizer's chat template; generated tokens are
appended exactly as the engine produced them. To append an observation after a generated turn, the
template is rendered with and without the new message and only the text *after the assistant's end
of turn* is tokenized. When the template rewrites history (the new render does not extend the old
one), `append_message` reports it and the caller starts a new trajectory segment.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase


@functools.lru_cache(maxsize=4096)
def _encode_cached(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[int, ...]:
    """The episodes of a group share their prompt: tokenize each rendered text once."""
    return tuple(tokenizer.encode(text, add_special_tokens=False))


@functools.lru_cache(maxsize=4096)
def _render_cached(tokenizer: PreTrainedTokenizerBase, key: str) -> str:
    """The episodes of a group start from the same messages: render the chat template once.
    ``key`` is the JSON of ``[messages, tools, add_generation_prompt]`` (key order kept)."""
    messages, tools, generation_prompt = json.loads(key)
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


@dataclass
class ChatTokens:
    tokenizer: PreTrainedTokenizerBase
    messages: list[dict[str, Any]] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # OpenAI-style tool schemas, passed to the chat template

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        messages = [m if m.get("content") is not None else {**m, "content": ""} for m in messages]
        try:
            key = json.dumps([messages, self.tools, generation_prompt])
        except TypeError:  # content that is not plain JSON: render it directly
            return self.tokenizer.apply_chat_template(
                messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
            )
        return _render_cached(self.tokenizer, key)

    def _encode(self, text: str) -> list[int]:
        return list(_encode_cached(self.tokenizer, text))

    def _extend_prompt(self, ids: list[int]) -> None:
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def start(self, messages: list[dict[str, str]]) -> None:
        """Begin (or restart as a new segment) with the full render of ``messages`` + generation prompt."""
        self.messages = list(messages)
        self.input_ids, self.loss_mask, self.logprobs, self.versions = [], [], [], []
        self._extend_prompt(self._encode(self._render(self.messages, generation_prompt=True)))

    def append_generation(self, tokens: list[int], logprobs: list[float], versions: list[int]) -> str:
        """Append the policy's tokens (loss tokens) and record the assistant message; return its text."""
        self.input_ids += tokens
        self.loss_mask += [1] * len(tokens)
        self.logprobs += logprobs
        self.versions += versions
        eos = self.tokenizer.eos_token_id
        text_tokens = tokens[:-1] if tokens and tokens[-1] == eos else tokens
        text = self.tokenizer.decode(text_tokens, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def append_message(self, role: str, content: str) -> bool:
        """Append an env message and the next generation prompt. False if the template rewrote history."""
        return self.append_messages([{"role": role, "content": content}])

    def append_messages(self, messages: list[dict[str, Any]]) -> bool:
        """Append messages after the last generated turn, then the generation prompt; False (nothing
        changed) if the template rewrote history, so the caller starts a new segment."""
        old = self._render(self.messages, generation_prompt=False)
        new_messages = [*self.messages, *messages]
        new = self._render(new_messages, generation_prompt=True)
        if not new.startswith(old):
            return False
        # The generated turn ends at the EOS token; what the template puts after it belongs to the prompt.
        eos_text = self.tokenizer.eos_token
        cut = old.rfind(eos_text)
        if cut < 0:
            return False
        if not self.input_ids or self.input_ids[-1] != self.tokenizer.eos_token_id:
            self._extend_prompt([self.tokenizer.eos_token_id])  # the turn hit its length limit
        self._extend_prompt(self._encode(new[cut + len(eos_text) :]))
        self.messages = new_messages
        return True
