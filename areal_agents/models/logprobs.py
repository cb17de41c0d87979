"""The temperature-scaled log-softmax, written once for the engine and the trainer.

The engine samples from ``log softmax(logits / T)`` and reports it at the sampled token (the behavior
logprob, π_behav); the trainer recomputes the same quantity with its own weights (π_prox, π_θ). Both
call `tempered_log_softmax`, so the importance ratio π_prox / π_behav is 1 wherever the weights agree.
A temperature ``T <= 0`` (greedy) counts as 1. Logits are taken in float32 whatever the model's dtype: the
head's matrix product itself runs in float32 (`fp32_head`), in the trainer's scores and the engine's sampling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from areal_agents.models.fp32_head import LOGPROB_CHUNK_VOCAB, head_token_logprobs, linear_head

LOGPROB_CHUNK_TOKENS = 1024


def tempered_log_softmax(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """``log softmax(logits / T)`` over the last dimension, in float32.

    ``temperature`` is a float, or a tensor of the leading dimensions of ``logits`` (one T per row).
    """
    logits = logits.float()
    if isinstance(temperature, torch.Tensor):
        scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        logits = logits / scale.reshape(scale.shape + (1,) * (logits.dim() - scale.dim()))
    elif temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def tempered_token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor
) -> torch.Tensor:
    """``log softmax(logits / T)`` at ``tokens``: logits ``[..., V]``, tokens ``[...]`` -> ``[...]``."""
    return tempered_log_softmax(logits, temperature).gather(-1, tokens[..., None]).squeeze(-1)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    temperature: float,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    rows: torch.Tensor | None = None,
    chunk_vocab: int = LOGPROB_CHUNK_VOCAB,
) -> torch.Tensor:
    """`tempered_token_logprobs` of ``head(hidden)`` (hidden ``[N, H]``, tokens ``[T]``), ``chunk_tokens``
    rows at a time: the ``[T, V]`` logits are never held for the whole sequence, in the forward or for the
    backward. Token t is scored from hidden row t, or ``rows[t]`` (a layout that repeats rows, as shared
    prompts do, is then gathered a chunk at a time, under activation checkpointing when gradients flow).

    A plain ``nn.Linear`` head (`linear_head`) runs in float32, ``chunk_vocab`` vocabulary columns at a time
    (`head_token_logprobs`); any other head (a LoRA on the head) runs as it is, under activation
    checkpointing, with only its log-softmax in float32."""
    parts = linear_head(head) if isinstance(head, torch.nn.Module) else None

    def chunk(h: torch.Tensor, y: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        h = h if r is None else h.index_select(0, r)
        if parts is not None:
            return head_token_logprobs(h, *parts, y, temperature, chunk_vocab)
        return tempered_token_logprobs(head(h), y, temperature)

    out = []
    for s in range(0, tokens.shape[0], chunk_tokens):
        y = tokens[s : s + chunk_tokens]
        h, r = (hidden[s : s + chunk_tokens], None) if rows is None else (hidden, rows[s : s + chunk_tokens])
        # the float32 head saves only its inputs and recomputes its logits in the backward: no checkpoint needed
        recompute = torch.is_grad_enabled() and h.requires_grad and (parts is None or r is not None)
        out.append(checkpoint(chunk, h, y, r, use_reentrant=False) if recompute else chunk(h, y, r))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float)
