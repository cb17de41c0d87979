"""Padding-free micro-batches: trajectories packed into one row, attention kept within each.

- `ffd_bins`: first-fit-decreasing bin packing of lengths under a token budget.
- `prompt_units`: trajectories grouped by identical prompt (a GRPO group's members), the packing unit
  when prompts are shared.
- `pack_rows`: concatenate a bin's trajectories into ``[1, T]`` tensors with restarting position ids
  and ``cu_seqlens`` boundaries. With ``share_prompts`` the model runs on a shorter row that holds each
  distinct prompt once, every completion attending to its prompt (`SharedPrompts`); hidden states are
  then gathered back to the trajectory layout, so losses and gradients are the unshared ones.
- ``packed_sdpa``: an attention implementation (registered with transformers' `AttentionInterface`)
  that follows an `AttentionPlan`: causal SDPA per sequence (or per prompt), and each completion over
  its prompt's keys and its own; similar lengths share one call, and no ``T x T`` mask is ever built.
- `packed_token_logprobs`: token logprobs of a packed row, computed from the final hidden states in
  chunks under activation checkpointing (`chunked_token_logprobs`), so the full-vocabulary log-softmax
  is never materialised for the whole row (long outputs stay cheap in memory).

The micro-batch type is `microbatch.py`'s; `batching.py` calls `pack_rows`, never the other way round.
"""

from __future__ import annotations

import functools
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
        shared=_share_prompts(trajs, starts) if share_prompts else None,
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
class _Pass:
    """One SDPA call over ``n`` sequences padded to ``width`` queries and ``key_width`` keys; ``mask``
    None means plain causal."""

    n: int
    width: int
    key_width: int
    mask: torch.Tensor | None


@dataclass(frozen=True)
class AttentionPlan:
    """The SDPA calls that make up attention over one packed row. Queries and keys of every call are
    gathered from the row in one ``index_select`` each (a pad points at token 0: its key is masked and
    its query's output dropped), so the backward pass scatters into one gradient per tensor rather
    than one per call; ``output_index`` picks each row position's output from the calls' outputs."""

    passes: tuple[_Pass, ...]
    query_index: torch.Tensor
    key_index: torch.Tensor
    output_index: torch.Tensor


@functools.lru_cache(maxsize=64)
def attention_plan(
    causal: tuple[tuple[int, int], ...], completions: tuple[tuple[int, int, int, int], ...], total: int
) -> AttentionPlan:
    """Causal attention within each ``(start, length)`` of ``causal``; each completion ``(start, length,
    prompt start, prompt length)`` attends to all of its prompt and causally to itself."""
    passes, queries, keys, output = [], [], [], torch.empty(total, dtype=torch.long)
    for bucket in _buckets(sorted(causal, key=lambda s: s[1])):
        width = max(n for _, n in bucket)
        _place(output, len(queries), width, [(s, n) for s, n in bucket])
        gather = [s + t if t < n else 0 for s, n in bucket for t in range(width)]
        queries += gather
        keys += gather
        passes.append(_Pass(len(bucket), width, width, None))
    for bucket in _buckets(sorted(completions, key=lambda c: c[1])):
        width, prompt_width = max(c[1] for c in bucket), max(c[3] for c in bucket)
        _place(output, len(queries), width, [(s, n) for s, n, _, _ in bucket])
        query = [s + t if t < n else 0 for s, n, _, _ in bucket for t in range(width)]
        for k, (_, _, p0, p) in enumerate(bucket):
            keys += [p0 + t if t < p else 0 for t in range(prompt_width)] + query[k * width : (k + 1) * width]
        queries += query
        prompt_ok = torch.arange(prompt_width)[None, :] < torch.tensor([c[3] for c in bucket])[:, None]  # [n, Pw]
        causal_ok = torch.ones(width, width, dtype=torch.bool).tril()  # [W, W]
        mask = torch.cat(
            [prompt_ok[:, None, :].expand(-1, width, -1), causal_ok[None].expand(len(bucket), -1, -1)], dim=2
        )[:, None]  # [n, 1, W, Pw + W]
        passes.append(_Pass(len(bucket), width, prompt_width + width, mask))
    return AttentionPlan(tuple(passes), torch.tensor(queries), torch.tensor(keys), output)


def _place(output: torch.Tensor, offset: int, width: int, spans: list[tuple[int, int]]) -> None:
    """Point each row position of ``spans`` at its query in a call laid out ``[len(spans), width]`` from ``offset``."""
    for k, (s, n) in enumerate(spans):
        output[s : s + n] = torch.arange(offset + k * width, offset + k * width + n)


def _buckets(spans: list) -> list[list]:
    """Consecutive runs of (length-sorted) sequences whose lengths are within 25% (or 8 tokens)."""
    out, i = [], 0
    while i < len(spans):
        shortest = spans[i][1]
        j = i + 1
        while j < len(spans) and j - i < BUCKET_SIZE and spans[j][1] <= max(shortest * 5 // 4, shortest + 8):
            j += 1
        out.append(spans[i:j])
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
    query_sizes = [p.n * p.width for p in plan.passes]
    key_sizes = [p.n * p.key_width for p in plan.passes]
    qs = query[0].index_select(1, plan.query_index).split(query_sizes, dim=1)  # [H, n * W, D] a call
    ks = key[0].index_select(1, plan.key_index).split(key_sizes, dim=1)
    vs = value[0].index_select(1, plan.key_index).split(key_sizes, dim=1)
    outs = []
    for p, q, k, v in zip(plan.passes, qs, ks, vs):
        q = q.unflatten(1, (p.n, p.width)).transpose(0, 1)  # [n, H, W, D]
        k, v = (x.unflatten(1, (p.n, p.key_width)).transpose(0, 1) for x in (k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scaling, dropout_p=dropout
        )
        outs.append(out.transpose(0, 1).flatten(1, 2))  # [H, n * W, D]
    out = torch.cat(outs, dim=1).index_select(1, plan.output_index)
    return out[None].transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)


def packed_hidden_states(decoder: PreTrainedModel, mb: MicroBatch) -> torch.Tensor:
    """Final hidden states ``[T, H]`` of a packed row (trajectory layout), attention kept within each trajectory."""
    shared: SharedPrompts | None = mb.shared
    if shared is None:
        edges = mb.cu_seqlens.tolist()
        plan = attention_plan(tuple((a, b - a) for a, b in zip(edges[:-1], edges[1:])), (), edges[-1])
        ids, positions = mb.input_ids, mb.position_ids
    else:
        plan = attention_plan(shared.prompts, shared.completions, shared.input_ids.shape[1])
        ids, positions = shared.input_ids, shared.position_ids
    use_packed_attention(decoder, True)
    hidden = decoder(input_ids=ids, position_ids=positions, use_cache=False, packed_plan=plan).last_hidden_state[0]
    return hidden if shared is None else hidden.index_select(0, shared.expand)


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
    hidden = packed_hidden_states(model.get_decoder(), mb)[:-1]  # position t predicts token t + 1
    logp = chunked_token_logprobs(hidden, model.get_output_embeddings(), mb.input_ids[0, 1:], temperature)
    logp = F.pad(logp, (1, 0))
    logp[mb.cu_seqlens[:-1].long()] = 0.0  # a trajectory's first token has no prefix (the previous one is another's)
    return logp[None]
