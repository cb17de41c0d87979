"""`PrefixCache`: the KV cache of finished requests, found again by the tokens it holds.

The next turn of a multi-turn episode sends the whole conversation again: the previous request's
context and output, then the env's reply. `HFEngine` keeps each finished row's keys and values
(for the current weights only) and prefills just the new tokens of a request that extends one, as
SGLang's radix cache does. Rows finished in one decode step are stored together as one block, all
layers' keys and values in one tensor, so that a prefill gathers its past with one copy per block.
Entries are keyed by the LoRA adapter they were computed with too (None: the base model): a row never
reuses another adapter's keys and values, and `drop` forgets one adapter's when it changes.

    cache = PrefixCache(max_tokens=65536)
    cache.add(keys, values, mask, token_keys)       # per layer [r, H, W, D]; mask [r, W]; a tuple per row
    hit = cache.find(context)                        # the longest stored prefix of context, or None
    cache.add(keys, values, mask, token_keys, adapter="a1")   # computed with LoRA adapter a1 ...
    hit = cache.find(context, adapter="a1")                    # ... found only for a1's rows
    cache.drop("a1")                                           # a1 replaced or unloaded
    keys, values, mask = cache.gather([hit, None])   # a right-aligned past for a prefill
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class _Block:
    kv: torch.Tensor  # [2 * layers, r, H, W, D]: every layer's keys, then every layer's values
    mask: torch.Tensor  # [r, W] 1 = a real cached token (rows may have holes: left and merge padding)
    token_keys: list[tuple[int, ...]]
    adapter: str | None = None  # the LoRA adapter its rows were computed with (None: the base model)

    @property
    def size(self) -> int:
        return self.mask.numel()  # cached columns, padding included


@dataclass(frozen=True)
class PrefixHit:
    block: _Block
    row: int
    length: int  # tokens of the context the cached row holds


class PrefixCache:
    """Finished rows' KV by their tokens; the oldest blocks go past ``max_tokens`` cached columns (padding
    included). `clear` it when the weights change."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self._size = 0
        # by length, then by (adapter, tokens)
        self._by_length: dict[int, dict[tuple[str | None, tuple[int, ...]], tuple[_Block, int]]] = {}
        self._longest_first: list[int] | None = None  # the stored lengths, sorted once per change

    def __len__(self) -> int:
        """Cached columns (tokens and padding) held now."""
        return self._size

    def clear(self) -> None:
        self._blocks.clear()
        self._by_length.clear()
        self._longest_first = None
        self._size = 0

    def add(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        mask: torch.Tensor,
        token_keys: list[tuple[int, ...]],
        adapter: str | None = None,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Store rows whose cached tokens are ``token_keys`` (a tuple per row, one per real column of ``mask``),
        computed with LoRA ``adapter`` (None: the base model); ``rows``: which rows of ``keys`` and ``values``
        those are (default: all), copied once into the block."""
        if self.max_tokens <= 0 or not token_keys:
            return
        first = int(mask.any(0).nonzero()[0]) if mask.any() else mask.shape[1]  # columns no row uses
        block = _Block(_stacked(keys + values, rows, first), mask[:, first:], token_keys, adapter)
        if block.size > self.max_tokens:
            return
        self._blocks[id(block)] = block
        self._size += block.size
        for row, key in enumerate(token_keys):
            if key:
                self._by_length.setdefault(len(key), {})[(adapter, key)] = (block, row)
        self._longest_first = None
        while self._size > self.max_tokens:
            self._evict(self._blocks.popitem(last=False)[1])

    def find(self, context: tuple[int, ...], adapter: str | None = None) -> PrefixHit | None:
        """The longest stored row of ``adapter``'s that is a proper prefix of ``context`` (one token at least
        is left to run)."""
        if self._longest_first is None:
            self._longest_first = sorted(self._by_length, reverse=True)
        for length in self._longest_first:
            if length < len(context) and (hit := self._by_length[length].get((adapter, context[:length]))) is not None:
                return PrefixHit(hit[0], hit[1], length)
        return None

    def gather(
        self, hits: list[PrefixHit | None], room: int = 0
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """A past KV cache for one prefill: row i holds ``hits[i]``'s tokens (right-aligned), or nothing; the
        keys and values have ``room`` zero columns after them (the mask does not), where a prefill can write
        its new tokens' without copying the past again."""
        used = [h for h in hits if h is not None]
        width = max(h.block.mask.shape[1] for h in used)
        two_layers, _, heads, _, dim = used[0].block.kv.shape
        kv = used[0].block.kv.new_zeros(two_layers, len(hits), heads, width + room, dim)
        mask = used[0].block.mask.new_zeros(len(hits), width)
        for i, h in enumerate(hits):  # row by row, straight into place (an indexed read copies to a temporary)
            if h is not None:
                w = h.block.mask.shape[1]
                mask[i, width - w :] = h.block.mask[h.row]
                kv[:, i, :, width - w : width] = h.block.kv[:, h.row]
        layers = two_layers // 2
        return list(kv[:layers]), list(kv[layers:]), mask

    def drop(self, adapter: str) -> None:
        """Forget the rows computed with LoRA ``adapter`` (replaced or unloaded)."""
        for key, block in list(self._blocks.items()):
            if block.adapter == adapter:
                del self._blocks[key]
                self._evict(block)

    def _evict(self, block: _Block) -> None:
        self._size -= block.size
        for row, key in enumerate(block.token_keys):
            index = self._by_length.get(len(key))
            if index is not None and index.get((block.adapter, key)) == (block, row):  # not overwritten since
                del index[(block.adapter, key)]
                if not index:
                    del self._by_length[len(key)]
        self._longest_first = None


def _stacked(tensors: list[torch.Tensor], rows: torch.Tensor | None, first: int) -> torch.Tensor:
    """``tensors`` ``[R, H, W, D]`` stacked, rows ``rows`` (all: None) from column ``first`` on, in one copy."""
    if rows is None:
        return torch.stack([t[:, :, first:] for t in tensors])
    head = tensors[0]
    out = head.new_empty(len(tensors), len(rows), head.shape[1], head.shape[2] - first, head.shape[3])
    for i, t in enumerate(tensors):
        torch.index_select(t[:, :, first:], 0, rows, out=out[i])
    return out
