"""The running batch of `HFEngine` (decode thread only): submissions, the KV cache segments their rows sit in,
and the in-place changes between steps (arrivals merged in, finished rows compacted out, segments merged).

Each segment holds rows admitted together, left-padded to its own width, so that a young row does not attend
over the padding of the oldest row's length; a decode step attends to every segment through `SegmentedCache`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from areal_agents.engines.hf.segmented_attention import SegmentedKV
from areal_agents.types import SamplingParams, StopReason

COMPACT_FRACTION = 0.0625  # drop finished rows from the cache once they are this share of the batch
MAX_SEGMENTS = 8  # KV cache segments of the running batch (each one an attention call per layer) ...
MERGE_CELLS = 256  # ... two segments merge when padding one to the other costs fewer (row x column) cells


@dataclass(eq=False)
class Submission:
    """One submission: shared between the caller's event loop and the decode thread."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stops: set[int]
    future: asyncio.Future
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_reason: StopReason | None = None
    abort: bool = False
    delivered: bool = False  # handed back; its row may stay in the batch until the next compaction
    start: float = field(default_factory=time.perf_counter)
    lora_name: str | None = None  # the LoRA adapter it is served with (None: the base model)


@dataclass
class Segment:
    """Rows decoded together: their left-padded KV cache and next input tokens. The running batch is a list
    of them, each as wide as its own rows need (`SegmentedKV`)."""

    rows: list[Submission] = field(default_factory=list)
    cache: DynamicCache | None = None
    attention: torch.Tensor | None = None  # [B, L] 1 = real token
    positions: torch.Tensor | None = None  # [B] position of each row's next input
    pending: torch.Tensor | None = None  # [B] sampled, not yet fed


@dataclass
class RunningBatch:
    """The running batch: segments of rows, oldest first (at most ``HFEngine.max_segments`` after a step)."""

    segments: list[Segment] = field(default_factory=list)

    @property
    def rows(self) -> list[Submission]:
        return [seq for segment in self.segments for seq in segment.rows]


class SegmentedCache(DynamicCache):
    """A decode step's cache as the model sees it: ``update`` writes each segment's rows into that
    segment's layer and returns them all as `SegmentedKV`, which `segmented_sdpa` attends to."""

    def __init__(self, segments: list[Segment], rows: list[slice], masks: list[torch.Tensor]) -> None:
        super().__init__()
        self.layers = list(segments[0].cache.layers)  # what transformers inspects (all full attention)
        self._segments, self._rows, self._masks = segments, rows, masks

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):  # noqa: ANN002, ANN003
        keys, values = [], []
        for segment, rows in zip(self._segments, self._rows):
            k, v = segment.cache.layers[layer_idx].update(key_states[rows], value_states[rows])
            keys.append(k)
            values.append(v)
        return SegmentedKV(keys, self._rows, self._masks), SegmentedKV(values, self._rows, self._masks)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(segment.cache.layers[layer_idx].get_seq_length() for segment in self._segments)


def merge(segment: Segment, new: Segment) -> None:
    """Append ``new``'s rows to ``segment``'s, left-padding the shorter cache to the same length."""
    if not segment.rows:
        segment.rows, segment.cache, segment.attention = new.rows, new.cache, new.attention
        segment.positions, segment.pending = new.positions, new.pending
        return
    width = max(segment.attention.shape[1], new.attention.shape[1])
    for old_layer, new_layer in zip(segment.cache.layers, new.cache.layers):
        old_layer.add_rows(new_layer.keys, new_layer.values)
    segment.attention = torch.cat(
        [
            F.pad(segment.attention, (width - segment.attention.shape[1], 0)),
            F.pad(new.attention, (width - new.attention.shape[1], 0)),
        ]
    )
    segment.rows = segment.rows + new.rows
    segment.positions = torch.cat([segment.positions, new.positions])
    segment.pending = torch.cat([segment.pending, new.pending])


def consolidate(segments: list[Segment], max_segments: int) -> None:
    """Merge neighbouring segments while padding the narrower to the wider costs fewer than `MERGE_CELLS`
    (row x column) cells a step, or while there are more than ``max_segments``: each segment is an
    attention call per layer, each padded cell K and V read for nothing at every step."""
    while len(segments) > 1:
        widths = [segment.attention.shape[1] for segment in segments]
        costs = [
            abs(widths[i] - widths[i + 1]) * len(segments[i if widths[i] < widths[i + 1] else i + 1].rows)
            for i in range(len(segments) - 1)
        ]
        i = min(range(len(costs)), key=costs.__getitem__)
        if costs[i] >= MERGE_CELLS and len(segments) <= max_segments:
            return
        wide, narrow = sorted(segments[i : i + 2], key=lambda segment: -segment.attention.shape[1])
        merge(wide, narrow)
        segments[i : i + 2] = [wide]


def compact(segment: Segment) -> None:
    """Drop a segment's delivered rows (with any all-padding columns) once they are `COMPACT_FRACTION` of it:
    the last live rows move into their places."""
    keep = [i for i, seq in enumerate(segment.rows) if not seq.delivered]
    if len(segment.rows) - len(keep) <= COMPACT_FRACTION * len(segment.rows) and keep:
        return
    if not keep:
        segment.rows, segment.cache = [], None
        return
    n = len(keep)
    holes = [i for i in range(n) if segment.rows[i].delivered]
    movers = [i for i in keep if i >= n]  # as many as there are holes
    order = list(range(n))
    for hole, mover in zip(holes, movers):
        order[hole] = mover
    device = segment.attention.device
    index = torch.tensor(order, device=device)
    segment.rows = [segment.rows[i] for i in order]
    segment.attention, segment.positions, segment.pending = (
        segment.attention[index],
        segment.positions[index],
        segment.pending[index],
    )
    first = int(segment.attention.any(0).nonzero()[0])  # leading columns nobody attends to any more
    segment.attention = segment.attention[:, first:]
    holes_t = torch.tensor(holes, dtype=torch.long, device=device)
    movers_t = torch.tensor(movers, dtype=torch.long, device=device)
    for layer in segment.cache.layers:
        layer.keep_rows(holes_t, movers_t, n, first)
