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

import torch
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
    dtype = key.parts[0].dtype  # a cache kept in another dtype than the model's: attend in the cache's
    q = query.to(dtype)
    outs = [
        sdpa_attention_forward(module, q[rows], k, v, mask.to(dtype), dropout, scaling, **kwargs)[0]
        for rows, k, v, mask in zip(key.rows, key.parts, value.parts, key.masks)
    ]
    return torch.cat(outs).to(query.dtype), None  # [B, q, H, D], as sdpa returns


AttentionInterface.register(SEGMENTED_SDPA, segmented_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(SEGMENTED_SDPA, sdpa_mask)  # prefill masks as sdpa's
