"""The text a model writes for an assistant turn (SFT targets, scripted engines), which is not always the
template's render of it: QwQ and DeepSeek-R1 open ``<think>`` in the generation prompt, gpt-oss drops earlier
analysis, Mistral moves the system prompt. Messages are adapted to the template with `template_message`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from areal_agents.chat.template_messages import template_message
from areal_agents.errors import ArealAgentsError

_MARK = "\x00areal-agents-turn\x00"  # stands in for a turn's content to find where the template starts it


def through_first_stop(tokenizer: PreTrainedTokenizerBase, stop_ids: list[int], text: str) -> list[int]:
    """The tokens of ``text`` up to its first stop token, inclusive: where generation ends (what the template
    writes after it, such as ChatML's newline, is the next prompt's)."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop_ids), None)
    if end is None:
        raise ArealAgentsError(f"the chat template ends the assistant turn {text!r} with none of the stop tokens")
    return tokens[:end]


def assistant_turn_text(
    tokenizer: PreTrainedTokenizerBase,
    history: list[dict[str, Any]],
    message: dict[str, Any],
    *,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The text a model generates for the assistant ``message`` after ``history`` and the generation prompt,
    as its chat template writes the turn: the template's render of the turn minus the generation prompt.

    Two templates render a turn otherwise than they prompt for it. QwQ and DeepSeek-R1 end the generation
    prompt with ``<think>\\n`` but render a past turn without its reasoning: the model writes the reasoning,
    ``</think>``, then the turn as rendered. gpt-oss drops earlier analysis once a final answer follows: the
    turn is found after the render of the message before it."""
    message = template_message(tokenizer.chat_template, message)

    def render(msgs: list[dict[str, Any]], generation_prompt: bool) -> str:
        msgs = [template_message(tokenizer.chat_template, m) if m["role"] == "assistant" else m for m in msgs]
        msgs = [m if m.get("content") is not None else {**m, "content": ""} for m in msgs]
        kwargs = template_kwargs or {}
        return tokenizer.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    try:
        return _turn_in_context(render, history, message)
    except ArealAgentsError:
        # The template renders this turn in context otherwise than it renders a turn it prompts for
        # (DeepSeek-R1 writes `<｜tool▁calls▁begin｜>` for the conversation's first call only, and after tool
        # outputs opens no turn): the model writes it as it would right after the user's message.
        users = [i for i, m in enumerate(history) if m["role"] == "user"]
        fresh = [m for m in history[:1] if m["role"] == "system"] + history[users[-1] : users[-1] + 1] if users else []
        if not fresh or fresh == history:
            raise
        return _turn_in_context(render, fresh, message)


def _turn_in_context(
    render: Callable[[list[dict[str, Any]], bool], str], history: list[dict[str, Any]], message: dict[str, Any]
) -> str:
    """The text a model writes for ``message`` after ``history`` (see `assistant_turn_text`)."""
    prompt, rendered = render(history, True), render([*history, message], False)
    if rendered.startswith(prompt):
        return rendered[len(prompt) :]
    before = render(history, False)
    opened = prompt[len(before) :] if prompt.startswith(before) else ""  # the generation prompt
    if rendered.startswith(before):
        turn = rendered[len(before) :]
    else:  # earlier turns rewritten: the turn follows the render of the last message before it
        anchor = before[-64:]
        at = rendered.rfind(anchor) if anchor else -1
        if at < 0:  # that message rewritten too (Mistral's system prompt): the turn follows the text before a
            marked = render([*history, {"role": "assistant", "content": _MARK}], False)  # stand-in turn
            at = marked.find(_MARK)
            if at < 0 or not rendered.startswith(marked[:at]):
                raise ArealAgentsError("the chat template renders the conversation before this assistant turn anew")
            anchor = ""
        turn = rendered[at + len(anchor) :]
    if turn.startswith(opened):
        return turn[len(opened) :]
    head = opened.rstrip().removesuffix("<think>")  # the generation prompt opens a think block (QwQ, DeepSeek-R1)
    if head != opened.rstrip() and turn.startswith(head):
        reasoning = message.get("reasoning_content") or ""
        return f"{reasoning}\n</think>\n\n{turn[len(head) :]}"
    raise ArealAgentsError(
        f"the chat template renders the assistant turn as {turn!r}, which does not continue its generation "
        f"prompt {opened!r}"
    )
