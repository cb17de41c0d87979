"""The engine's forward passes through transformers' own model code: for models `LlamaDecodeStep` does not
take and for rows served with LoRA adapters (whose module hooks run there).

    cache, logits = prefill(model, input_ids, positions, attention, past)   # left-padded rows
    logits = decode(model, input_ids, positions, cache)                      # one token a row (SegmentedCache)
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from areal_agents.engines.hf.decode_step import head_logits
from areal_agents.engines.hf.multi_lora import LoraRows

# Columns one prefill call runs: its attention mask is [rows, 1, chunk, context] rather than [rows, 1, W, W],
# so re-running a long context (a resumed 16K-token answer) costs memory linear in its length.
PREFILL_CHUNK_TOKENS = 2048


def prefill(  # noqa: PLR0913
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attention: torch.Tensor,
    past: list[tuple[torch.Tensor, torch.Tensor]] | None,
    lora: LoraRows | None = None,
) -> tuple[DynamicCache, torch.Tensor]:
    """Left-padded rows ``input_ids [n, w]`` after ``past`` (each layer's cached keys and values; ``attention
    [n, p + w]`` covers both): the cache and each row's last logits (float32, plus ``lora``'s head deltas)."""
    width = input_ids.shape[1]
    context = attention.shape[1] - width  # cached prefix columns before the new ones
    cache = None if past is None else DynamicCache(ddp_cache_data=past)
    for c0 in range(0, width, PREFILL_CHUNK_TOKENS):
        c1 = min(width, c0 + PREFILL_CHUNK_TOKENS)
        out = model.get_decoder()(
            input_ids=input_ids[:, c0:c1],
            attention_mask=attention[:, : context + c1],
            position_ids=positions[:, c0:c1],
            cache=cache,
            use_cache=True,
        )
        cache = out.cache
    return cache, head_logits(model, out.last_hidden_state[:, -1], lora)


def decode(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache: DynamicCache,
    lora: LoraRows | None = None,
) -> torch.Tensor:
    """Next-token logits ``[B, V]`` (float32) of one token ``input_ids [B]`` a row; ``cache`` brings its own
    masks (a `SegmentedCache`), so the attention mask passed is a placeholder."""
    hidden = model.get_decoder()(
        input_ids=input_ids[:, None],
        attention_mask=torch.zeros((len(input_ids), 1, 1, 1), dtype=model.dtype, device=input_ids.device),
        position_ids=positions[:, None],
        cache=cache,
        use_cache=True,
    ).last_hidden_state[:, -1]
    return head_logits(model, hidden, lora)
