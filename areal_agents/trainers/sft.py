"""Supervised fine-tuning on the same data path as RL: conversations become trajectories.

Assistant messages become loss tokens (exactly as a generation would: content tokens + EOS); system,
user and tool messages and the template's scaffolding are prompt tokens. Loss: mean negative
log-likelihood over loss tokens.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from areal_agents.agents.chat_tokens import ChatTokens
from areal_agents.models.device import autocast
from areal_agents.trainers.batching import make_micro_batches, token_logprobs
from areal_agents.trainers.optim import optimizer_step
from areal_agents.types import Trajectory


def conversation_to_trajectory(messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase) -> Trajectory:
    """Tokenize a conversation the way `ChatAgent` would have produced it, loss on assistant turns."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    chat = ChatTokens(tokenizer)
    chat.start(messages[:first])
    for m in messages[first:]:
        if m["role"] == "assistant":
            tokens = tokenizer.encode(m["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
            chat.append_generation(tokens, [0.0] * len(tokens), [-1] * len(tokens))
        elif not chat.append_message(m["role"], m["content"]):
            break  # the template rewrites history here; train on the prefix
    return Trajectory(chat.input_ids, chat.loss_mask, chat.logprobs, chat.versions)


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
