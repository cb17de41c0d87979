"""The LM head in float32: next-token logits for sampling, and token logprobs chunked over the vocabulary.

A bfloat16 head rounds each logit to 8 significant bits (an error of about 0.4% of its size), and on a
150k-token vocabulary that error is a main part of the mismatch between the engine's behavior logprobs
(π_behav) and the trainer's (π_prox, π_θ). Here the head's matrix product runs in float32 whatever the
model's dtype: the hidden states and the weight are upcast, autocast is off for it, and the accumulation is
float32. Under FSDP2 mixed precision the weight arrives all-gathered in ``param_dtype`` (bfloat16) and is
upcast here, so the product and its sums are float32 while the weight itself keeps bfloat16's rounding (a
float32 ``lm_head`` parameter would remove that too; not done). On CUDA a float32 product runs off the
tensor cores unless TF32 is allowed; with bfloat16 inputs TF32 loses nothing (their 8 bits fit its 11), a
speed-up left to measure on a GPU.

The trainer scores tokens with `head_token_logprobs`: ``log softmax(h W^T / T)`` at the target token as a
running logsumexp over vocabulary chunks plus the target's logit, never the ``[T, V]`` float32 logits at
once. Its backward recomputes each chunk's logits and sums the gradients chunk by chunk (memory linear in
the vocabulary chunk, as in the forward): for target y and upstream gradient g,
``dL/dz_v = g (1[v = y] - p_v) / T``, ``dh = Σ_v dz_v W_v``, ``dW_v = dz_v h``.

    logits = float32_logits(hidden_last, model.get_output_embeddings())    # [B, V] float32, for sampling
    logp = head_token_logprobs(hidden, weight, bias, tokens, temperature)  # [T] float32, differentiable
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

LOGPROB_CHUNK_VOCAB = 16384  # vocabulary columns of one chunk: [tokens, 16384] float32 logits at a time


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs (a gradient check): never below float32."""
    return torch.promote_types(dtype, torch.float32)


def linear_head(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``head``'s weight and bias when it is a plain ``nn.Linear`` whose forward nobody hooks; None otherwise
    (a PEFT LoRA layer on the head, a separately sharded head): its own forward must then run."""
    hooked = head._forward_hooks or head._forward_pre_hooks  # noqa: SLF001
    if type(head) is not nn.Linear or hooked:
        return None
    return head.weight, head.bias


def float32_logits(hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """``head(hidden)`` as float32 logits ``[..., V]``; a plain ``nn.Linear`` head's product runs in float32
    (the engine's sampling logits: last positions only). Any other head runs as it is, its output upcast;
    the engine's LoRA hooks on the head are not run here (`LoraRows.add` adds their deltas)."""
    if type(head) is not nn.Linear:
        return head(hidden).float()
    dtype = compute_dtype(hidden.dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if head.bias is None else head.bias.to(dtype)
        return F.linear(hidden.to(dtype), head.weight.to(dtype), bias)


def head_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tokens: torch.Tensor,
    temperature: float,
    chunk_vocab: int = LOGPROB_CHUNK_VOCAB,
) -> torch.Tensor:
    """``log softmax((hidden W^T + b) / T)`` at ``tokens`` (hidden ``[N, H]``, weight ``[V, H]``, tokens ``[N]``),
    float32 (float64 for float64 inputs), ``chunk_vocab`` columns of logits at a time in the forward and the
    backward. ``T <= 0`` (greedy) counts as 1."""
    scale = 1.0 / temperature if temperature > 0 else 1.0
    return _HeadLogprobs.apply(hidden, weight, bias, tokens, scale, chunk_vocab)


class _HeadLogprobs(torch.autograd.Function):
    """`head_token_logprobs` with a backward that recomputes the logits a vocabulary chunk at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, scale, chunk_vocab):  # noqa: ANN001, ANN205
        ctx.scale, ctx.chunk_vocab = scale, chunk_vocab
        dtype = compute_dtype(hidden.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)
            lse = h.new_full(tokens.shape, float("-inf"))
            target = h.new_zeros(tokens.shape)
            for v0, v1, w, b in _chunks(weight, bias, chunk_vocab, dtype):
                z = _logits(h, w, b, scale)
                lse = torch.logaddexp(lse, torch.logsumexp(z, -1))
                inside, column = _in_chunk(tokens, v0, v1)
                target = torch.where(inside, z.gather(1, column[:, None]).squeeze(1), target)
        ctx.save_for_backward(hidden, weight, bias, tokens, lse)
        return target - lse

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        hidden, weight, bias, tokens, lse = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        dtype = compute_dtype(hidden.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            h, g = hidden.to(dtype), grad.to(dtype)
            dh = torch.zeros_like(h) if want_h else None
            dw = torch.empty_like(weight) if want_w else None
            db = torch.empty_like(bias) if want_b else None
            for v0, v1, w, b in _chunks(weight, bias, ctx.chunk_vocab, dtype):
                # dz = g (1[v = y] - p) / T, with p = exp(z / T - lse)
                dz = (_logits(h, w, b, ctx.scale) - lse[:, None]).exp_().mul_(-g[:, None])
                inside, column = _in_chunk(tokens, v0, v1)
                dz.scatter_add_(1, column[:, None], torch.where(inside, g, 0.0)[:, None])  # no host sync
                dz.mul_(ctx.scale)
                if dh is not None:
                    dh.addmm_(dz, w)
                if dw is not None:
                    dw[v0:v1] = (dz.T @ h).to(weight.dtype)
                if db is not None:
                    db[v0:v1] = dz.sum(0).to(bias.dtype)
        return None if dh is None else dh.to(hidden.dtype), dw, db, None, None, None


def _chunks(
    weight: torch.Tensor, bias: torch.Tensor | None, size: int, dtype: torch.dtype
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
    """``(v0, v1, W[v0:v1], b[v0:v1])`` in ``dtype``, a vocabulary chunk at a time."""
    for v0 in range(0, weight.shape[0], size):
        v1 = min(weight.shape[0], v0 + size)
        yield v0, v1, weight[v0:v1].to(dtype), None if bias is None else bias[v0:v1].to(dtype)


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, scale: float) -> torch.Tensor:
    return F.linear(h, w, b).mul_(scale)


def _in_chunk(tokens: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens fall in columns ``[v0, v1)``, and each one's column there (clamped in range for the others)."""
    return (tokens >= v0) & (tokens < v1), (tokens - v0).clamp(0, v1 - v0 - 1)
