"""Padding-free micro-batches: trajectories packed into one row, attention kept within each.

- `ffd_bins`: first-fit-decreasing bin packing of lengths under a token budget.
- `prompt_units`: trajectories grouped by identical prompt (a GRPO group's members), the packing unit
  when prompts are shared.
- `pack_rows`: concatenate a bin's trajectories into ``[1, T]`` tensors with restarting position ids
  and ``cu_seqlens`` boundaries. With ``share_prompts`` the model runs on a shorter row that holds each
  distinct prompt once, every completion attending to its prompt (`SharedPrompts`); hidden states are
  then gathered back to the trajectory layout, so losses and gradients are the unshared ones.
- ``packed_sdpa``: an attention implementation (registered with transformers' `AttentionInterface`)
  that follows an `AttentionPlan`: causal SDPA (no mask at all) per sequence, a completion's sequence
  being its prompt's tokens then its own; similar lengths share one call. Memory stays linear in length:
  no ``T x T`` or ``W x (P + W)`` mask is built, and the kernel skips the masked triangle.
- `packed_token_logprobs`: token logprobs of a packed row, computed from the final hidden states by a
  float32 head in chunks of tokens and of the vocabulary (`chunked_token_logprobs`), so the
  full-vocabulary log-softmax is never materialised for the whole row (long outputs stay cheap in memory).

The micro-batch type is `microbatch.py`'s; `batching.py` calls `pack_rows`, never the other way round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from areal_agents.models.logprobs import chunked_token_logprobs
from areal_agents.trainers.microbatch import MicroBatch, SharedPrompts
from areal_agents.types import Trajectory

PACKED_ATTENTION = "areal_packed_sdpa"
BUCKET_SIZE = 64  # sequences per SDPA call at most


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


def prompt_length(t: Trajectory) -> int:
    """Tokens before the first trained one: what the trajectories of one prompt have in common."""
    return next((k for k, m in enumerate(t.loss_mask) if m), len(t))


def prompt_units(trajs: Sequence[Trajectory], capacity: int) -> tuple[list[list[int]], list[int]]:
    """Trajectories with the same prompt, split so that a unit's shared row fits ``capacity`` tokens
    (prompt once + every completion), and each unit's row length."""
    units, sizes = [], []
    for prompt, members in _by_prompt(trajs).items():
        unit, size = [], len(prompt)
        for i in members:
            extra = len(trajs[i]) - len(prompt)
            if unit and size + extra > capacity:
                units.append(unit)
                sizes.append(size)
                unit, size = [], len(prompt)
            unit.append(i)
            size += extra
        units.append(unit)
        sizes.append(size)
    return units, sizes


def pack_rows(
    trajs: list[Trajectory],
    adv: list[float],
    index: list[int],
    prox_logprobs: Sequence[torch.Tensor] | None = None,
    share_prompts: bool = False,
) -> MicroBatch:
    """One packed micro-batch ``[1, T]`` of ``trajs`` (``index``: their positions in the caller's list)."""
    # by length: the attention plan buckets similar lengths, and in this order its outputs need no reordering
    order = sorted(range(len(trajs)), key=lambda k: len(trajs[k]))
    trajs, adv, index = [trajs[k] for k in order], [adv[k] for k in order], [index[k] for k in order]
    lengths = [len(t) for t in trajs]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    ids = torch.tensor([tok for t in trajs for tok in t.input_ids])[None]
    loss_mask = torch.tensor([m for t in trajs for m in t.loss_mask], dtype=torch.float)[None]
    logprobs = torch.tensor([lp for t in trajs for lp in t.logprobs], dtype=torch.float)[None]
    versions = torch.tensor([v for t in trajs for v in t.versions], dtype=torch.long)[None]
    advantages = torch.tensor([a for a, n in zip(adv, lengths) for _ in range(n)], dtype=torch.float)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    slices = [(0, a, b) for a, b in zip(starts[:-1], starts[1:])]
    mb = MicroBatch(
        index,
        ids,
        loss_mask,
        logprobs,
        advantages * loss_mask,
        slices=slices,
        position_ids=positions,
        cu_seqlens=torch.tensor(starts, dtype=torch.int32),
        shared=_share_prompts(trajs, starts) if share_prompts else None,
        versions=versions,
    )
    if prox_logprobs is not None:
        mb.prox_logprobs = torch.cat([prox_logprobs[i] for i in index])[None]
    return mb


def _by_prompt(trajs: Sequence[Trajectory]) -> dict[tuple[int, ...], list[int]]:
    """Indices of the trajectories of each distinct prompt, in order."""
    out: dict[tuple[int, ...], list[int]] = {}
    for i, t in enumerate(trajs):
        out.setdefault(tuple(t.input_ids[: prompt_length(t)]), []).append(i)
    return out


def _share_prompts(trajs: list[Trajectory], starts: list[int]) -> SharedPrompts:
    ids: list[int] = []
    positions: list[int] = []
    expand = [0] * starts[-1]
    prompts, completions = [], []
    for prompt, members in _by_prompt(trajs).items():
        p0, p = len(ids), len(prompt)
        ids += prompt
        positions += range(p)
        if p:
            prompts.append((p0, p))
        for k in members:
            t, s0 = trajs[k], len(ids)
            ids += t.input_ids[p:]
            positions += range(p, len(t))
            expand[starts[k] : starts[k] + p] = range(p0, p0 + p)
            expand[starts[k] + p : starts[k + 1]] = range(s0, s0 + len(t) - p)
            if len(t) > p:
                completions.append((s0, len(t) - p, p0, p))
    return SharedPrompts(
        torch.tensor(ids)[None], torch.tensor(positions)[None], torch.tensor(expand), tuple(prompts), tuple(completions)
    )


# ---- attention over a packed row ---------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionPlan:
    """Attention over one packed row as causal SDPA calls and no mask. Each call runs ``n`` sequences padded
    at the end to ``width``; a sequence is read from the row by ``index`` (a pad points at token 0: it
    comes after every real key, so causality hides it, and its output is dropped). ``output_index`` picks
    each row position's output from the calls' outputs. A completion's sequence is its prompt then itself,
    so it attends to all of the prompt and causally to itself without a ``W x (P + W)`` mask."""

    widths: tuple[tuple[int, int], ...]  # (n, width) of each call
    index: torch.Tensor
    output_index: torch.Tensor

    def to(self, device: torch.device) -> AttentionPlan:
        """The plan's indices on ``device`` (where the row's activations are); itself when there already."""
        if self.index.device == device:
            return self
        return AttentionPlan(self.widths, self.index.to(device), self.output_index.to(device))


def attention_plan(
    causal: Sequence[tuple[int, int]], completions: Sequence[tuple[int, int, int, int]], total: int
) -> AttentionPlan:
    """Causal attention within each ``(start, length)`` of ``causal``; each completion ``(start, length,
    prompt start, prompt length)`` attends to all of its prompt and causally to itself. A prompt's own
    outputs come from its first completion's call (the same causal attention), or from a call of its own
    when it has none. Built per forward: nothing holds a plan after the update that used it."""
    sequences = []  # (row segments read in order as one sequence, how many leading tokens give no output)
    prompted = set()
    for s, n, p0, p in completions:
        sequences.append((((p0, p), (s, n)), p if (p0, p) in prompted else 0))
        prompted.add((p0, p))
    sequences += [(((s, n),), 0) for s, n in causal if (s, n) not in prompted]
    lengths = [sum(n for _, n in segments) for segments, _ in sequences]
    order = sorted(range(len(sequences)), key=lengths.__getitem__)
    widths, index, output = [], [], torch.empty(total, dtype=torch.long)
    offset = 0
    for bucket in _buckets([lengths[k] for k in order]):
        width = lengths[order[bucket[-1]]]  # ascending: the bucket's last is its longest
        for k in bucket:
            segments, skip = sequences[order[k]]
            read = torch.cat([torch.arange(s, s + n) for s, n in segments])
            index.append(F.pad(read, (0, width - len(read))))
            output[read[skip:]] = torch.arange(offset + skip, offset + len(read))
            offset += width
        widths.append((len(bucket), width))
    return AttentionPlan(tuple(widths), torch.cat(index), output)


def _buckets(lengths: list[int]) -> list[range]:
    """Consecutive runs of (ascending) ``lengths`` within 25% (or 8 tokens) of their shortest, as index ranges."""
    out, i = [], 0
    while i < len(lengths):
        shortest = lengths[i]
        j = i + 1
        while j < len(lengths) and j - i < BUCKET_SIZE and lengths[j] <= max(shortest * 5 // 4, shortest + 8):
            j += 1
        out.append(range(i, j))
        i = j
    return out


def packed_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):  # noqa: ANN001
    """Attention over a packed row as its `AttentionPlan` (kwarg ``packed_plan``) says; ``[B, T, H, D]``."""
    plan: AttentionPlan | None = kwargs.get("packed_plan")
    if plan is None:
        raise ValueError(f"{PACKED_ATTENTION} needs packed_plan (packed inputs)")
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    sizes = [n * width for n, width in plan.widths]
    qs, ks, vs = (x[0].index_select(1, plan.index).split(sizes, dim=1) for x in (query, key, value))  # [H, n * W, D]
    outs = []
    for (n, width), q, k, v in zip(plan.widths, qs, ks, vs):
        q, k, v = (x.unflatten(1, (n, width)).transpose(0, 1) for x in (q, k, v))  # [n, H, W, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout)
        outs.append(out.transpose(0, 1).flatten(1, 2))  # [H, n * W, D]
    out = torch.cat(outs, dim=1).index_select(1, plan.output_index)
    return out[None].transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)


def packed_hidden_states(decoder: PreTrainedModel, mb: MicroBatch) -> torch.Tensor:
    """Final hidden states ``[T, H]`` of a packed row (trajectory layout), attention kept within each trajectory."""
    hidden, expand = _run_hidden_states(decoder, mb)
    return hidden if expand is None else hidden.index_select(0, expand)


def _run_hidden_states(decoder: PreTrainedModel, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Final hidden states of the row the model runs on, and (shared prompts) the row position of each
    token of the trajectory layout; None when the two layouts are the same."""
    shared: SharedPrompts | None = mb.shared
    if shared is None:
        edges = mb.cu_seqlens.tolist()
        plan = attention_plan([(a, b - a) for a, b in zip(edges[:-1], edges[1:])], (), edges[-1])
        ids, positions = mb.input_ids, mb.position_ids
    else:
        plan = attention_plan(shared.prompts, shared.completions, shared.input_ids.shape[1])
        ids, positions = shared.input_ids, shared.position_ids
    use_packed_attention(decoder, True)
    plan = plan.to(ids.device)
    hidden = decoder(input_ids=ids, position_ids=positions, use_cache=False, packed_plan=plan).last_hidden_state[0]
    return hidden, None if shared is None else shared.expand


def use_packed_attention(decoder: PreTrainedModel, packed: bool) -> None:
    """Switch ``decoder`` to packed attention, or back to what it had. The switch outlives the forward:
    activation checkpointing re-runs the layers during backward, which must see the same attention."""
    current = decoder.config._attn_implementation  # noqa: SLF001
    if packed and current != PACKED_ATTENTION:
        decoder._areal_unpacked_attention = current  # noqa: SLF001
        decoder.set_attn_implementation(PACKED_ATTENTION)
    elif not packed and current == PACKED_ATTENTION:
        decoder.set_attn_implementation(getattr(decoder, "_areal_unpacked_attention", "sdpa"))


def packed_token_logprobs(model: PreTrainedModel, mb: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / T)`` of each token of a packed row, ``[1, T]``; 0 where a trajectory starts."""
    hidden, expand = _run_hidden_states(model.get_decoder(), mb)
    rows = None if expand is None else expand[:-1]  # shared prompts: read in chunks, never expanded whole
    head, tokens = model.get_output_embeddings(), mb.input_ids[0, 1:]  # position t predicts token t + 1
    logp = chunked_token_logprobs(hidden if rows is not None else hidden[:-1], head, tokens, temperature, rows=rows)
    logp = F.pad(logp, (1, 0))
    logp[mb.cu_seqlens[:-1].long()] = 0.0  # a trajectory's first token has no prefix (the previous one is another's)
    return logp[None]
