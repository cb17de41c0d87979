"""Attention over a KV cache held in segments: groups of rows, each with a cache as wide as its own rows need.

`HFEngine` decodes rows admitted at different times together. One left-padded cache is as wide as its
oldest row: on the count recipe rows attended to 69 of 164 columns on average, and one-token attention,
bound by reading K and V, spent most of its time on padding. So the engine keeps the running rows in
segments (rows admitted together, each left-padded to its own width), and its cache's ``update`` returns
`SegmentedKV`: one K (V) tensor per segment, with the batch rows it serves and their attention mask.
`SEGMENTED_SDPA` attends each segment with sdpa and concatenates the rows; for ordinary tensors (prefill,
training, ``generate``) it is plain sdpa.

    model.set_attn_implementation(SEGMENTED_SDPA)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

SEGMENTED_SDPA = "areal_segmented_sdpa"


@dataclass
class SegmentedKV:
    """Keys (or values) of a batch in segments: ``parts[i]`` ``[rows, kv_heads, width_i, head_dim]`` serves
    the batch rows ``rows[i]``, whose additive mask is ``masks[i]`` ``[rows, 1, 1, width_i]`` (0 or -inf)."""

    parts: list[torch.Tensor]
    rows: list[slice]
    masks: list[torch.Tensor]


def segmented_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):  # noqa: ANN001
    """sdpa per segment of `SegmentedKV` keys and values (``attention_mask`` is then unused); else sdpa."""
    if not isinstance(key, SegmentedKV):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return attend_segments(query, key, value, scaling, dropout).transpose(1, 2).contiguous(), None  # [B, q, H, D]


def attend_segments(
    query: torch.Tensor, keys: SegmentedKV, values: SegmentedKV, scale: float | None = None, dropout: float = 0.0
) -> torch.Tensor:
    """``query [B, H, q, D]`` attending each segment's rows to its keys and values, in the cache's dtype (a
    cache kept in another dtype than the model's); ``[B, H, q, D]`` in the query's dtype. One query a row (a
    decode step) runs `one_token_attention`, the rest sdpa."""
    dtype = keys.parts[0].dtype
    q = query.to(dtype)
    if query.shape[2] == 1 and not dropout and q.device.type == "cpu":  # (CUDA's sdpa kernels decode well)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        attend = partial(one_token_attention, scale=scale)
    else:
        gqa = query.shape[1] != keys.parts[0].shape[1]
        attend = partial(_sdpa, dropout=dropout, scale=scale, gqa=gqa)
    outs = [attend(q[rows], k, v, mask) for rows, k, v, mask in zip(keys.rows, keys.parts, values.parts, keys.masks)]
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).to(query.dtype)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    dropout: float,
    scale: float | None,
    gqa: bool,
) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa)


def one_token_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``query [B, H, 1, D]`` against ``keys``, ``values [B, kv_heads, L, D]`` under the additive ``mask [B, 1,
    1, L]``, as two batched matrix products: on CPU sdpa's flash kernel, made for long queries, took ~1.4x as
    long for one (a decode step's largest cost). Grouped heads share their key's product; the softmax runs in
    float32, as sdpa's does."""
    b, heads, _, d = query.shape
    groups = heads // keys.shape[1]
    q = query.reshape(b, keys.shape[1], groups, d)  # head h reads key head h // groups
    scores = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scale).add_(mask)  # [B, kv_heads, groups, L]
    return torch.matmul(scores.softmax(-1).to(values.dtype), values).view(b, heads, 1, d)


AttentionInterface.register(SEGMENTED_SDPA, segmented_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(SEGMENTED_SDPA, sdpa_mask)  # prefill masks as sdpa's
