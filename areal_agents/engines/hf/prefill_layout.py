"""`PrefillLayout`: the rows of one prefill as the model runs them.

Each distinct context runs from its longest cached prefix (`PrefixCache`): only its new tokens, left-padded
so that every row's next token sits in the last column, rows with the most new tokens first (a prefill's
chunks then take consecutive rows, views of its buffers rather than gathered copies).

    layout = PrefillLayout.of(contexts, adapters, prefixes, pad_token_id, device)
    past = layout.gather(prefixes, room, dtype)   # the cached columns (None: no hit); extends layout.attention
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areal_agents.engines.hf.prefix_cache import PrefixCache, PrefixHit
from areal_agents.engines.hf.running_batch import Submission


@dataclass
class PrefillLayout:
    """Rows ``order[i]`` of the contexts given, ``cached[i]`` tokens of each from ``hits[i]``."""

    order: list[int]  # which context each row is
    hits: list[PrefixHit | None]
    cached: list[int]  # tokens of each row the prefix cache holds
    adapters: list[str | None]  # each row's LoRA adapter (None: the base model)
    input_ids: torch.Tensor  # [n, width] the new tokens, left-padded
    positions: torch.Tensor  # [n, width]
    attention: torch.Tensor  # [n, columns] 1 = a real token: the cached columns (after `gather`), then the new
    new_tokens: int  # the rows' new tokens, padding not counted

    @classmethod
    def of(
        cls,
        contexts: list[tuple[int, ...]],
        adapters: list[str | None],
        prefixes: PrefixCache,
        pad_token_id: int,
        device: torch.device,
    ) -> PrefillLayout:
        hits = [prefixes.find(c, a) if len(prefixes) else None for c, a in zip(contexts, adapters)]
        start = [h.length if h is not None else 0 for h in hits]
        order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]) - start[i], reverse=True)
        news = [contexts[i][start[i] :] for i in order]
        width = len(news[0])
        input_ids = torch.full((len(news), width), pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(news), width), dtype=torch.long)
        for i, new in enumerate(news):
            input_ids[i, width - len(new) :] = torch.tensor(new)
            attention[i, width - len(new) :] = 1
        cached = [start[i] for i in order]
        positions = (attention.cumsum(-1) - 1).clamp(min=0) + torch.tensor(cached)[:, None]
        # built on the host, moved once (on CPU `to` is the tensor itself)
        input_ids, attention, positions = (t.to(device) for t in (input_ids, attention, positions))
        hits, adapters = [hits[i] for i in order], [adapters[i] for i in order]
        return cls(order, hits, cached, adapters, input_ids, positions, attention, sum(map(len, news)))

    @property
    def width(self) -> int:
        """New-token columns."""
        return self.input_ids.shape[1]

    @property
    def columns(self) -> int:
        """Columns of the cache the prefill leaves: the cached ones (the widest hit's), then the new ones."""
        return self.width + max((h.block.mask.shape[1] for h in self.hits if h is not None), default=0)

    def gather(
        self, prefixes: PrefixCache, room: int, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Each layer's cached keys and values in ``dtype``, with ``room`` zero columns after them, their mask
        put before `attention`'s; None when no row has a cached prefix."""
        if not any(self.cached):
            return None
        keys, values, mask = prefixes.gather(self.hits, room=room)
        self.attention = torch.cat([mask, self.attention], dim=1)
        return [(k.to(dtype), v.to(dtype)) for k, v in zip(keys, values)]


def distinct_contexts(rows: list[Submission]) -> tuple[list[tuple[int, ...]], list[str | None], list[int]]:
    """The distinct (adapter, context) pairs of ``rows``: contexts, adapters, and which one each row has."""
    distinct: dict[tuple[str | None, tuple[int, ...]], int] = {}
    owner = [distinct.setdefault((s.lora_name, tuple(s.input_ids + s.tokens)), len(distinct)) for s in rows]
    return [c for _, c in distinct], [a for a, _ in distinct], owner


def decode_columns(rows: list[Submission]) -> int:
    """Columns the rows' decode steps may add to their cache (the most tokens any may still generate)."""
    return max(s.sampling.max_new_tokens - len(s.tokens) for s in rows)
