"""Supervised fine-tuning on the same data path as RL: conversations become trajectories.

Assistant messages become loss tokens (exactly as a generation would: content tokens + EOS); system,
user and tool messages and the template's scaffolding are prompt tokens. Loss: mean negative
log-likelihood over loss tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from areal_agents.agents.assistant_turns import assistant_turn_text, through_first_stop
from areal_agents.agents.chat_tokens import ChatTokens
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
        tokens = through_first_stop(tokenizer, chat.stop_ids, text)
        chat.append_generation(tokens, [0.0] * len(tokens), [-1] * len(tokens))
    segments.append(chat)
    return [Trajectory(c.input_ids, c.loss_mask, c.logprobs, c.versions) for c in segments if any(c.loss_mask)]


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
