"""Padding-free micro-batches: trajectories packed into one row, attention kept within each.

- `ffd_bins`: first-fit-decreasing bin packing of lengths under a token budget.
- `pack_rows`: concatenate a bin's trajectories into ``[1, T]`` tensors with restarting position ids
  and ``cu_seqlens`` boundaries.
- ``varlen_sdpa``: an attention implementation (registered with transformers' `AttentionInterface`)
  that runs causal SDPA per trajectory from ``cu_seq_lens_q``, so no ``T x T`` mask is ever built.
- `packed_token_logprobs`: token logprobs of a packed row, computed from the final hidden states in
  chunks under activation checkpointing, so the full-vocabulary log-softmax is never materialised for
  the whole row (long outputs stay cheap in memory).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface, PreTrainedModel

from areal_agents.types import Trajectory

VARLEN_ATTENTION = "areal_varlen_sdpa"
LOGPROB_CHUNK_TOKENS = 1024


def ffd_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices grouped into bins of total length <= ``capacity`` (a longer item gets a bin of its own)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack_rows(
    trajs: list[Trajectory],
    adv: list[float],
    index: list[int],
    prox_logprobs: Sequence[torch.Tensor] | None = None,
):  # -> MicroBatch (batching imports this module lazily)
    from areal_agents.trainers.batching import MicroBatch  # noqa: PLC0415

    order = sorted(range(len(trajs)), key=lambda k: len(trajs[k]))  # equal lengths adjacent: fewer SDPA calls
    trajs, adv, index = [trajs[k] for k in order], [adv[k] for k in order], [index[k] for k in order]
    lengths = [len(t) for t in trajs]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    ids = torch.tensor([tok for t in trajs for tok in t.input_ids])[None]
    loss_mask = torch.tensor([m for t in trajs for m in t.loss_mask], dtype=torch.float)[None]
    logprobs = torch.tensor([lp for t in trajs for lp in t.logprobs], dtype=torch.float)[None]
    advantages = torch.tensor([a for a, n in zip(adv, lengths) for _ in range(n)], dtype=torch.float)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    slices = [(0, a, b) for a, b in zip(starts[:-1], starts[1:])]
    mb = MicroBatch(
        index,
        ids,
        None,
        loss_mask,
        logprobs,
        advantages * loss_mask,
        slices=slices,
        position_ids=positions,
        cu_seqlens=torch.tensor(starts, dtype=torch.int32),
    )
    if prox_logprobs is not None:
        mb.prox_logprobs = torch.cat([prox_logprobs[i] for i in index])[None]
    return mb


def varlen_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):  # noqa: ANN001
    """Causal attention within each packed sequence (``cu_seq_lens_q`` boundaries); output ``[B, T, H, D]``.

    Sequences of similar length (`pack_rows` sorts them) are right-padded into one SDPA call per bucket:
    with a causal mask a real query never sees the padding after it, so no mask is built, and the
    padding exists only inside attention, never in the linear layers.
    """
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        raise ValueError(f"{VARLEN_ATTENTION} needs cu_seq_lens_q (packed inputs)")
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    total = query.shape[2]
    padded = [torch.cat([x[0], x.new_zeros(x.shape[1], 1, x.shape[3])], dim=1) for x in (query, key, value)]
    outs = []
    for gather, width, keep in _buckets(tuple(bounds.tolist()), total):
        q, k, v = (x.index_select(1, gather).unflatten(1, (-1, width)).transpose(0, 1) for x in padded)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout)
        outs.append(out.transpose(0, 1).flatten(1, 2).index_select(1, keep))  # [H, real tokens, D]
    return torch.cat(outs, dim=1)[None].transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=64)
def _buckets(edges: tuple[int, ...], total: int) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """For each bucket of similar-length sequences: the gather index into the row (``total`` = a zero
    pad position), its padded width, and which gathered positions are real (in row order)."""
    spans = list(zip(edges[:-1], edges[1:]))
    out = []
    i = 0
    while i < len(spans):
        shortest = spans[i][1] - spans[i][0]
        j = i + 1
        while j < len(spans) and j - i < 64 and spans[j][1] - spans[j][0] <= max(shortest * 5 // 4, shortest + 8):
            j += 1
        bucket = spans[i:j]
        width = max(e - s for s, e in bucket)
        gather = [s + t if t < e - s else total for s, e in bucket for t in range(width)]
        keep = [k * width + t for k, (s, e) in enumerate(bucket) for t in range(e - s)]
        out.append((torch.tensor(gather), width, torch.tensor(keep)))
        i = j
    return out


AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa)


def packed_hidden_states(decoder: PreTrainedModel, mb) -> torch.Tensor:  # noqa: ANN001
    """Final hidden states ``[T, H]`` of a packed row, attention kept within each trajectory."""
    previous = decoder.config._attn_implementation  # noqa: SLF001
    decoder.set_attn_implementation(VARLEN_ATTENTION)
    try:
        cu = mb.cu_seqlens
        max_len = int((cu[1:] - cu[:-1]).max())
        return decoder(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            use_cache=False,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max_len,
            max_length_k=max_len,
        ).last_hidden_state[0]
    finally:
        decoder.set_attn_implementation(previous)


def packed_token_logprobs(model: PreTrainedModel, mb, temperature: float = 1.0) -> torch.Tensor:  # noqa: ANN001
    """``log softmax(logits / T)`` of each token of a packed row, ``[1, T]``; 0 where a trajectory starts."""
    cu = mb.cu_seqlens
    hidden = packed_hidden_states(model.get_decoder(), mb)[:-1]  # position t predicts token t + 1
    head = model.get_output_embeddings()
    targets = mb.input_ids[0, 1:]
    scale = 1.0 / temperature if temperature > 0 else 1.0

    def chunk_logprobs(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(h).float() * scale
        return logits.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)

    parts = []
    for s in range(0, targets.shape[0], LOGPROB_CHUNK_TOKENS):
        h, y = hidden[s : s + LOGPROB_CHUNK_TOKENS], targets[s : s + LOGPROB_CHUNK_TOKENS]
        parts.append(checkpoint(chunk_logprobs, h, y, use_reentrant=False) if h.requires_grad else chunk_logprobs(h, y))
    logp = F.pad(torch.cat(parts), (1, 0))
    logp[cu[:-1].long()] = 0.0  # a trajectory's first token has no prefix (the previous one is another's)
    return logp[None]
