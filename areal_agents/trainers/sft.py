"""Supervised fine-tuning on the same data path as RL: conversations become trajectories.

Assistant messages become loss tokens (exactly as a generation would: content tokens + EOS); system,
user and tool messages and the template's scaffolding are prompt tokens. Loss: mean negative
log-likelihood over loss tokens.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from areal_agents.agents.chat_tokens import ChatTokens, template_reads
from areal_agents.chat.parsers import ReplyParser
from areal_agents.errors import ArealAgentsError
from areal_agents.models.device import autocast
from areal_agents.trainers.batching import make_micro_batches, token_logprobs
from areal_agents.trainers.optim import optimizer_step
from areal_agents.types import Trajectory


def conversation_to_trajectory(
    messages: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> Trajectory:
    """The first segment of `conversation_to_segments`: the whole conversation unless the template
    rewrites history in it."""
    return conversation_to_segments(messages, tokenizer, tools, template_kwargs)[0]


def conversation_to_segments(
    messages: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[Trajectory]:
    """Tokenize a conversation the way `ChatAgent` / `ToolAgent` would have produced it, loss on assistant
    turns: each assistant turn's tokens are what the model generates for it (`assistant_turn_text`), and
    where the template rewrites history (Qwen3 and QwQ drop earlier reasoning) a new segment starts, as in RL."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    chat = ChatTokens(tokenizer, tools=tools, template_kwargs=template_kwargs)
    chat.start(messages[:first])
    segments: list[ChatTokens] = []
    pending: list[dict[str, Any]] = []
    for m in messages[first:]:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending and not chat.append_messages(pending):
            segments.append(chat)  # the template rewrote history here: a new segment, as the agent starts one
            chat = ChatTokens(tokenizer, tools=tools, template_kwargs=template_kwargs)
            chat.start([*segments[-1].messages, *pending])
        pending = []
        text = assistant_turn_text(tokenizer, chat.messages, m, tools=tools, template_kwargs=template_kwargs)
        tokens = _through_first_stop(tokenizer, chat.stop_ids, text)
        chat.append_generation(tokens, [0.0] * len(tokens), [-1] * len(tokens))
        chat.messages[-1] = template_message(tokenizer.chat_template, chat.messages[-1])  # DeepSeek-R1's text args
    segments.append(chat)
    return [Trajectory(c.input_ids, c.loss_mask, c.logprobs, c.versions) for c in segments if any(c.loss_mask)]


def _through_first_stop(tokenizer: PreTrainedTokenizerBase, stop_ids: list[int], text: str) -> list[int]:
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

    prompt, rendered = render(history, True), render([*history, message], False)
    if rendered.startswith(prompt):
        return rendered[len(prompt) :]
    before = render(history, False)
    opened = prompt[len(before) :] if prompt.startswith(before) else ""  # the generation prompt
    if rendered.startswith(before):
        turn = rendered[len(before) :]
    else:  # earlier turns rewritten: the turn follows the render of the last message before it
        anchor = before[-64:]
        at = rendered.rfind(anchor)
        if not anchor or at < 0:
            raise ArealAgentsError("the chat template renders the conversation before this assistant turn anew")
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


def template_message(chat_template: str | None, message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI assistant message in the fields ``chat_template`` reads: ``reasoning_content`` becomes
    ``thinking`` where the template reads only that (gpt-oss); tool-call arguments are JSON text where the
    template joins them as strings (DeepSeek-R1); calls go into the content, in the format the template's
    tool parser reads, where it renders no ``tool_calls`` (Granite)."""
    reads = template_reads(chat_template)
    message = dict(message)
    if message.get("reasoning_content") is not None and "reasoning_content" not in reads and "thinking" in reads:
        message["thinking"] = message.pop("reasoning_content")
    calls = message.get("tool_calls")
    if not calls:
        return message
    if "tool_calls" not in reads:
        written = _calls_as_text(ReplyParser.for_template(chat_template).tool_parser, calls)
        message.pop("tool_calls")
        message["content"] = (message.get("content") or "") + written
    elif "['function']['arguments'] +" in (chat_template or ""):
        message["tool_calls"] = [_arguments_as_text(c) for c in calls]
    return message


def _arguments_as_text(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"]["arguments"]
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {**call, "function": {**call["function"], "arguments": text}}


def _calls_as_text(tool_parser: str, calls: list[dict[str, Any]]) -> str:
    """Calls written into a reply's text in the format ``tool_parser`` reads (for templates that render
    no ``tool_calls``)."""
    objects = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    if tool_parser == "granite":
        return "<|tool_call|>" + json.dumps(objects, ensure_ascii=False)
    if tool_parser == "hermes":
        return "".join(f"<tool_call>\n{json.dumps(o, ensure_ascii=False)}\n</tool_call>" for o in objects)
    raise ArealAgentsError(f"cannot write tool calls in the {tool_parser!r} format into a reply's text")


def sft_update(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trajectories: list[Trajectory],
    *,
    micro_batch_tokens: int,
    max_grad_norm: float,
    pad_token_id: int,
    compute_dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """One optimizer step of token-weighted NLL over the loss tokens of ``trajectories``, on the model's
    device, the forward and backward under autocast to ``compute_dtype`` (float32: none)."""
    device = next(model.parameters()).device
    model.train()
    # Padded micro-batches: the SFT figures in docs/benchmarks.md were measured so (packing: the same gradients).
    mbs = make_micro_batches(trajectories, micro_batch_tokens, pad_token_id=pad_token_id, pack=False)
    total = sum(mb.num_loss_tokens for mb in mbs)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for mb in mbs:
        mb = mb.to(device)
        with autocast(device, compute_dtype):
            logp = token_logprobs(model, mb)
        loss = -(logp.float() * mb.loss_mask).sum() / max(total, 1)
        loss.backward()
        loss_sum += float(loss.detach())
    grad_norm = optimizer_step(model, optimizer, max_grad_norm, scheduler=scheduler)
    return {
        "loss": loss_sum,
        "grad_norm": grad_norm,
        "lr": scheduler.get_last_lr()[0],
        "loss_tokens": float(total),
    }
