"""`GrowingLayer`: a KV cache layer that changes in place as `HFEngine`'s running batch changes."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from areal_agents.models.loading import DTYPES


class GrowingLayer(DynamicLayer):
    """A KV cache layer kept in a buffer with spare rows and columns, so that the running batch changes
    in place: a decode step writes its column, arrivals write their rows, finished rows are replaced by
    the last ones and leading columns nobody attends to are dropped, without copying the whole cache
    (`DynamicLayer` concatenates every step; merging arrivals by concatenation copied every row).

    ``keys`` / ``values`` are views ``room[:rows, :, start:start + width]``; one the engine replaces by
    another tensor (a prefill's rows picked by index) is copied into fresh room when next changed."""

    @classmethod
    def adopt(cls, layer: DynamicLayer, max_rows: int, dtype: torch.dtype | None = None) -> GrowingLayer:
        """``layer`` (a prefill's) as a growing one whose room holds ``dtype`` keys and values (default: its own)."""
        grown = cls()
        grown.__dict__.update(layer.__dict__)
        grown._room, grown._start, grown._view, grown._max_rows = None, 0, None, max_rows
        grown._dtype = dtype or layer.keys.dtype
        return grown

    @classmethod
    def over(
        cls, room: tuple[torch.Tensor, torch.Tensor], width: int, max_rows: int, dtype: torch.dtype
    ) -> GrowingLayer:
        """A layer whose keys and values are the first ``width`` columns of ``room`` ``[rows, kv_heads, columns,
        D]`` (a prefill's buffers, cast to ``dtype`` if they are not in it): its decode steps write the columns
        after them in place, without copying the cache on admission."""
        grown = cls()
        grown.is_initialized, grown.device = True, room[0].device
        room = tuple(r.to(dtype) for r in room)
        grown._room, grown._start, grown._max_rows, grown._dtype = room, 0, max_rows, dtype
        grown._show(room[0].shape[0], width)
        return grown

    def _make_room(self, rows: int, left: int, right: int) -> None:
        """Ensure room for ``rows`` rows, ``left`` columns before the view and ``right`` after it."""
        n, width = self.keys.shape[0], self.keys.shape[-2]
        room = self._room
        if (
            room is not None
            and self.keys is self._view
            and room[0].shape[0] >= rows
            and self._start >= left
            and room[0].shape[2] - self._start - width >= right
        ):
            return
        capacity = max(rows, min(self._max_rows, 2 * rows))
        self._start = max(left, 8, width // 4)
        columns = self._start + width + max(right, spare_columns(width))
        room = tuple(
            x.new_empty(capacity, x.shape[1], columns, x.shape[-1], dtype=self._dtype) for x in (self.keys, self.values)
        )
        for r, x in zip(room, (self.keys, self.values)):
            # columns a row does not attend to are masked and must hold finite numbers: the ones a wider arrival
            # may bring into view are zeroed (spare rows' when `add_rows` takes them; right ones are written first)
            r[:n, :, : self._start].zero_()
            r[:n, :, self._start : self._start + width] = x
        self._room = room
        self._show(n, width)

    def _show(self, rows: int, width: int) -> None:
        keys, values = self._room
        self.keys = keys[:rows, :, self._start : self._start + width]
        self.values = values[:rows, :, self._start : self._start + width]
        self._view = self.keys

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003
        if not self.is_initialized or self.keys.numel() == 0:
            return super().update(key_states, value_states, *args, **kwargs)
        n, width, add = self.keys.shape[0], self.keys.shape[-2], key_states.shape[-2]
        self._make_room(n, 0, add)
        end = self._start + width
        self._room[0][:n, :, end : end + add] = key_states
        self._room[1][:n, :, end : end + add] = value_states
        self._show(n, width + add)
        return self.keys, self.values

    def add_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append rows whose last column lines up with the batch's (left padding; wider ones widen it)."""
        n, width = self.keys.shape[0], self.keys.shape[-2]
        k, w = keys.shape[0], keys.shape[-2]
        wider = max(0, w - width)
        self._make_room(n + k, wider, 0)
        self._start -= wider
        end = self._start + width + wider
        for r, x in zip(self._room, (keys, values)):
            r[n : n + k, :, : end - w].zero_()
            r[n : n + k, :, end - w : end] = x
        self._show(n + k, width + wider)

    def keep_rows(self, holes: torch.Tensor, movers: torch.Tensor, rows: int, drop_columns: int) -> None:
        """Keep the first ``rows`` rows, the last rows ``movers`` copied into ``holes``; drop leading columns."""
        n, width = self.keys.shape[0], self.keys.shape[-2]
        if self.keys is not self._view:
            self._make_room(n, 0, 0)
        if len(holes):
            for x in self._room:
                x[holes, :, self._start : self._start + width] = x[movers, :, self._start : self._start + width]
        self._start += drop_columns
        self._show(rows, width - drop_columns)


def spare_columns(width: int) -> int:
    """Columns a growing cache ``width`` wide makes room for at once (half as many again, 16 at least)."""
    return max(16, width // 2)


def kv_dtype_of(kv_dtype: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: 'auto' (the model's), a name of `DTYPES` or a torch dtype."""
    if isinstance(kv_dtype, torch.dtype):
        return kv_dtype
    if kv_dtype in (None, "auto"):
        return model_dtype
    if kv_dtype not in DTYPES:
        raise ValueError(f"kv_dtype: expects one of {sorted(['auto', *DTYPES])}, got {kv_dtype!r}")
    return DTYPES[kv_dtype]
