"""`BatchRunner`: one step of `HFEngine`'s running batch on the model (decode thread only).

A step admits arrivals (a prefill, from the longest cached prefix of each context), decodes one token for
every row over all KV cache segments, samples, and retires finished rows into the prefix cache. The decode
step runs in the arrivals' last prefill pass over the weights (`admit_decoding`). An error in
one request's prefill, decode step or sampling fails that request alone: a failed batch prefill is redone
row by row, a failed decode step row by row (prefill, then one step alone). Rows may carry LoRA adapters
(`LoraTable`): each forward adds their deltas grouped by adapter, and the prefix cache keys on the adapter.
The next-token logits are float32 whatever the model's dtype (`head_logits`: the head's product upcast).
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from areal_agents.engines.hf import transformers_forward
from areal_agents.engines.hf.decode_step import LlamaDecodeStep
from areal_agents.engines.hf.engine_placement import Placement, moved_weights_error, weight_versions
from areal_agents.engines.hf.kv_buffer import GrowingLayer, kv_dtype_of, spare_columns
from areal_agents.engines.hf.multi_lora import LoraTable
from areal_agents.engines.hf.prefill_layout import PrefillLayout, decode_columns, distinct_contexts
from areal_agents.engines.hf.prefix_cache import PrefixCache
from areal_agents.engines.hf.running_batch import (
    RunningBatch,
    Segment,
    SegmentedCache,
    Submission,
    compact,
    consolidate,
)
from areal_agents.engines.hf.sampling import sample_rows, seeded_draws, uniforms, unsampleable
from areal_agents.engines.hf.stats import EngineStats
from areal_agents.errors import ConfigError, EngineError
from areal_agents.types import GenResponse, StopReason

Outcome = tuple[Submission, GenResponse | BaseException]  # a submission and what its caller gets


class BatchRunner:
    """The model's work on the running batch. Rows it finishes or fails go to ``outbox``, which the
    scheduler hands back to their callers after the step."""

    def __init__(
        self,
        model: PreTrainedModel,
        stats: EngineStats,
        *,
        pad_token_id: int,
        max_batch_size: int,
        seed: int,
        prefix_cache_tokens: int,
        max_segments: int,
        kv_dtype: str | torch.dtype | None,
        fast_decode: bool,
        compile_decode: bool = False,
        placement: Placement | None = None,
        recompute_adapters: bool = True,
    ) -> None:
        self.model, self.stats = model, stats
        self.placement = placement or Placement(model.device, model.dtype, model.dtype)
        self.device = self.placement.device  # of the model, the KV cache, masks, positions and sampling
        # decode steps of Llama-family models run `LlamaDecodeStep` (False, or another model: transformers' forward)
        self.decode_step = LlamaDecodeStep.of(model, self.placement.dtype) if fast_decode else None
        self.compiled = compiled_decode(self.decode_step, max_batch_size) if compile_decode else None
        self.sliding_window = _sliding_window(model)  # the segments' masks attend to every column
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.prefixes = PrefixCache(prefix_cache_tokens)  # finished rows' KV
        self.max_segments = max_segments  # KV cache segments (1: one cache, left-padded to the oldest row)
        self.kv_dtype = kv_dtype_of(kv_dtype, self.placement.dtype)  # of the KV cache decode steps attend to
        self.outbox: list[Outcome] = []  # finished this step
        # weights shared with a trainer: their in-place versions at the last push, and that push's version
        self.pushed: tuple[tuple[int, ...], int] | None = None
        self.lora = LoraTable(model)  # the LoRA adapters served beside the base model
        self.recompute_adapters = recompute_adapters  # a changed adapter re-prefills the running rows (stale_kv)

    def compile_decode(self) -> None:
        """Compile the decode step's graphs (``compile_decode``), on the decode thread before its first step."""
        if self.compiled is not None:
            with self.placement.precision(), torch.inference_mode():
                self.compiled.compile_buckets(self.device)

    def new_weights(self, version: int, shared: bool) -> None:
        """The model has new weights (at a step boundary): the decode step derives its fused ones again;
        ``shared``: remember the weights' in-place versions, which must not move until the next push."""
        if self.decode_step is not None:
            self.decode_step.refresh()
        self.pushed = (weight_versions(self.model), version) if shared else None

    @torch.inference_mode()
    def step(
        self,
        batch: RunningBatch,
        incoming: list[Submission],
        stale: bool,
        version: int,
        adapters: frozenset = frozenset(),
    ) -> None:
        """Admit (and re-prefill after a weight swap), then one decode step; retire finished rows. ``adapters``:
        the LoRA adapters loaded, replaced or unloaded since the last step."""
        if self.pushed is not None and weight_versions(self.model) != self.pushed[0]:
            self.step_on_moved_weights(batch, incoming)
            return
        with self.placement.precision():
            self.run_step(batch, incoming, stale, version, adapters)

    def step_on_moved_weights(self, batch: RunningBatch, incoming: list[Submission]) -> None:
        """Shared weights changed since their push: a request left to decode stops the engine (its tokens
        would come from weights of no version); requests all cancelled or aborted (a synchronous run's
        leftovers, which the trainer may outrun) are handed back without touching the model."""
        if any(not s.abort for s in incoming) or any(not (s.delivered or s.abort) for s in batch.rows):
            raise moved_weights_error(self.pushed[1])
        for seq in incoming:
            self.finish(seq, "abort")
        self.retire(batch)

    def run_step(
        self, batch: RunningBatch, incoming: list[Submission], stale: bool, version: int, adapters: frozenset
    ) -> None:
        """`step` in the engine's precision."""
        start = time.perf_counter()
        live = [s for s in incoming if not s.abort]
        for seq in incoming:
            if seq.abort:
                self.finish(seq, "abort")
        if stale:
            self.prefixes.clear()
        replay = self.adapters_changed(batch, adapters) if adapters else False
        live = [s for s in live if self.has_adapter(s)]
        if (stale or replay) and batch.segments:  # the cache holds the old weights' keys and values
            live = [s for s in batch.rows if not s.delivered] + live
            batch.segments = []
        mixed = bool(live and batch.segments) and self.mixes(batch, live)
        if mixed:
            self.admit_decoding(batch, live, version)
        elif live:
            self.admit(batch, live, version)
        if not mixed:
            self.decode_or_redo(batch, version)
        self.stats.max_running = max(self.stats.max_running, sum(not s.delivered for s in batch.rows))
        self.stats.busy_seconds += time.perf_counter() - start

    def adapters_changed(self, batch: RunningBatch, adapters: frozenset) -> bool:
        """LoRA ``adapters`` changed: forget their cached prefixes, fail running rows whose adapter is gone;
        True when running rows use one and their KV must be recomputed (every running row is, then)."""
        for name in adapters:
            self.prefixes.drop(name)
        running = [s for s in batch.rows if not (s.delivered or s.abort)]  # aborted ones end as "abort"
        for seq in running:
            self.has_adapter(seq)
        return self.recompute_adapters and any(s.lora_name in adapters and not s.delivered for s in running)

    def has_adapter(self, seq: Submission) -> bool:
        """Whether ``seq``'s LoRA adapter is loaded; if not (unloaded after the request was checked), fail it."""
        if seq.lora_name is None or seq.lora_name in self.lora:
            return True
        loaded = ", ".join(sorted(self.lora.adapters)) or "none"
        self.fail(seq, EngineError(f"LoRA adapter {seq.lora_name!r} was unloaded (loaded: {loaded})"))
        return False

    def admit(self, batch: RunningBatch, rows: list[Submission], version: int) -> None:
        """Prefill ``rows`` into the running batch (a segment of their own, or merged by `retire`); if that
        fails, each row alone, so that only the rows whose own prefill fails fail."""
        try:
            batch.segments.append(self.prefill(rows, version))
        except Exception as e:  # noqa: BLE001
            if len(rows) == 1:
                self.fail(rows[0], e)
            else:
                for seq in rows:
                    self.admit(batch, [seq], version)
        self.retire(batch)

    def redecode_alone(self, batch: RunningBatch, version: int) -> None:
        """A decode step failed (its cache is now unusable): redo it row by row (prefill, then one decode
        step of that row alone); the rows that fail alone fail with their error, the others go on."""
        rows = [s for s in batch.rows if not s.delivered]
        batch.segments = []
        for seq in rows:
            alone = RunningBatch()
            try:
                alone.segments.append(self.prefill([seq], version))
                self.retire(alone)  # a row the prefill's token finished does not decode again
                if alone.segments:
                    self.decode(alone, version)
            except Exception as e:  # noqa: BLE001
                self.fail(seq, e)
                continue
            batch.segments += alone.segments

    def prefill(self, rows: list[Submission], version: int) -> Segment:
        """Run the rows' contexts through the model; identical ones (a GRPO group's prompt) run once and
        their cache rows are copied, so a group of G costs one prompt's compute, not G. A context that
        extends a finished request's (the next turn of an episode) runs only its new tokens, and so do
        resumed rows of one group after a weight swap (their prompt runs once)."""
        contexts, adapters, owner = distinct_contexts(rows)
        if self.prefixes.max_tokens > 0:
            self.cache_shared_prompts(rows)
        return self.seat(rows, owner, *self.forward(contexts, adapters, decode_columns(rows)), version)

    def seat(  # noqa: PLR0913
        self,
        rows: list[Submission],
        owner: list[int],
        cache: DynamicCache,
        attention: torch.Tensor,
        positions: torch.Tensor,
        logits: torch.Tensor,
        order: list[int],
        version: int,
    ) -> Segment:
        """The segment of prefilled ``rows`` (row i ran context ``owner[i]``; the cache's rows are contexts
        ``order``), their first tokens sampled: rows of identical contexts get copies of its cache row."""
        if len(order) < len(rows):
            at = {c: i for i, c in enumerate(order)}
            index = torch.tensor([at[c] for c in owner], device=self.device)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
            attention, positions, logits = attention[index], positions[index], logits[index]
        else:  # the rows in the cache's order
            row_of = {c: r for r, c in enumerate(owner)}
            rows = [rows[row_of[c]] for c in order]
        pending, _ = self.sample(rows, logits, version)
        return Segment(rows, cache, attention, positions + 1, pending)

    def mixes(self, batch: RunningBatch, rows: list[Submission]) -> bool:
        """Whether ``rows`` may be prefilled with the decode step: the model's own step, no LoRA rows, new
        contexts (not resumed ones)."""
        if self.decode_step is None or any(s.lora_name is not None or s.tokens for s in rows):
            return False
        return all(s.lora_name is None for s in batch.rows)

    def admit_decoding(self, batch: RunningBatch, rows: list[Submission], version: int) -> None:
        """Prefill ``rows`` with the running batch's decode step in the prefill's last pass over the weights
        (one pass fewer a step, and products of more rows); if that fails, the decode step is redone row by
        row and the rows admitted apart."""
        contexts, adapters, owner = distinct_contexts(rows)
        layout = PrefillLayout.of(contexts, adapters, self.prefixes, self.pad_token_id, self.device)
        spare = min(decode_columns(rows), spare_columns(layout.columns))
        try:
            past = layout.gather(self.prefixes, layout.width + spare, self.model.dtype)
            ids, positions, cache, slices = self.decode_inputs(batch)
            prefill = (layout.input_ids, layout.positions, layout.attention, past, spare)
            logits, first, layers = self.decode_step.decode_and_prefill(ids, positions, cache, prefill)
            self.decoded(batch, logits, slices, version)
        except Exception:  # noqa: BLE001  (one request's fault must not fail the others)
            self.redecode_alone(batch, version)
            self.retire(batch)
            self.admit(batch, rows, version)
            return
        self.count_prefill(layout)
        cache = self.cache_over(layers, layout.columns)
        segment = self.seat(rows, owner, cache, layout.attention, layout.positions[:, -1], first, layout.order, version)
        batch.segments.append(segment)
        self.retire(batch)

    def decode_or_redo(self, batch: RunningBatch, version: int) -> None:
        """One decode step of the running batch; if it fails, row by row (`redecode_alone`). Then `retire`."""
        if batch.segments:
            try:
                self.decode(batch, version)
            except Exception:  # noqa: BLE001  (one request's fault must not fail the others)
                self.redecode_alone(batch, version)
            self.retire(batch)

    def cache_shared_prompts(self, rows: list[Submission]) -> None:
        """Rows that run their own tokens again (resumed after a weight swap) but share a prompt (a GRPO
        group): run each such prompt once into the prefix cache, so that every row runs only its tokens."""
        tails: dict[tuple[str | None, tuple[int, ...]], set[tuple[int, ...]]] = {}  # (adapter, prompt)
        for seq in rows:
            if seq.tokens:
                tails.setdefault((seq.lora_name, tuple(seq.input_ids)), set()).add(tuple(seq.tokens))
        by_adapter: dict[str | None, list[tuple[int, ...]]] = {}
        for (adapter, prompt), ends in tails.items():
            hit = self.prefixes.find(prompt + next(iter(ends)), adapter) if len(self.prefixes) else None
            if len(ends) > 1 and (hit is None or hit.length < len(prompt)):
                by_adapter.setdefault(adapter, []).append(prompt)
        for adapter, prompts in by_adapter.items():
            cache, attention, _, _, order = self.forward(prompts, [adapter] * len(prompts))
            self.prefixes.add(
                [layer.keys for layer in cache.layers],
                [layer.values for layer in cache.layers],
                attention,
                [prompts[i] for i in order],
                adapter,
            )

    def forward(
        self, contexts: list[tuple[int, ...]], adapters: list[str | None], decode: int = 0
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """Prefill distinct contexts (`PrefillLayout`: each from its longest cached prefix of its LoRA adapter's,
        rows with the most new tokens first): the cache (room for up to ``decode`` more columns), its attention
        mask, each row's last position and last logits, and which context each row is."""
        layout = PrefillLayout.of(contexts, adapters, self.prefixes, self.pad_token_id, self.device)
        lora = self.lora.rows_of(layout.adapters, self.device)
        fused = self.decode_step is not None and lora is None
        spare = min(decode, spare_columns(layout.columns)) if fused else 0  # the decode steps' room
        # the past in kv_dtype, the prefill in the model's; the fused one writes after it in place
        past = layout.gather(self.prefixes, layout.width + spare if fused else 0, self.model.dtype)
        ids, positions, attention = layout.input_ids, layout.positions, layout.attention
        if fused:
            logits, layers = self.decode_step.prefill(ids, positions, attention, past, spare)
            cache = self.cache_over(layers, layout.columns)
        else:
            with self.lora.serving(lora):
                cache, logits = transformers_forward.prefill(self.model, ids, positions, attention, past, lora)
            cache.layers = [GrowingLayer.adopt(layer, self.max_batch_size, self.kv_dtype) for layer in cache.layers]
        self.count_prefill(layout)
        return cache, attention, positions[:, -1], logits, layout.order

    def cache_over(self, layers: list[tuple[torch.Tensor, torch.Tensor]], columns: int) -> DynamicCache:
        """A cache over the prefill's buffers as they are (the first ``columns`` of each layer's)."""
        cache = DynamicCache()
        cache.layers = [GrowingLayer.over(kv, columns, self.max_batch_size, self.kv_dtype) for kv in layers]
        return cache

    def count_prefill(self, layout: PrefillLayout) -> None:
        self.stats.prefills += 1
        self.stats.prefill_tokens += layout.new_tokens
        self.stats.prefix_hit_tokens += sum(layout.cached)

    def decode(self, batch: RunningBatch, version: int) -> None:
        """One token for every row: one forward over all segments, each attending to its own cache."""
        input_ids, positions, cache, rows = self.decode_inputs(batch)
        lora = self.lora.rows_of([s.lora_name for s in batch.rows], self.device)
        with self.lora.serving(lora):
            step = self.compiled or self.decode_step or partial(transformers_forward.decode, self.model)
            logits = step(input_ids, positions, cache, lora)
        self.decoded(batch, logits, rows, version)

    def decode_inputs(self, batch: RunningBatch) -> tuple[torch.Tensor, torch.Tensor, SegmentedCache, list[slice]]:
        """A decode step's input tokens and positions, its cache over the segments, and each segment's rows."""
        if self.sliding_window is not None:
            self.fail_past_window(batch)
        rows, masks, start = [], [], 0
        for segment in batch.segments:
            n = len(segment.rows)
            ones = torch.ones((n, 1), dtype=torch.long, device=self.device)
            segment.attention = torch.cat([segment.attention, ones], dim=1)
            rows.append(slice(start, start + n))
            start += n
            bias = torch.zeros(segment.attention.shape, dtype=self.kv_dtype, device=self.device)
            masks.append(bias.masked_fill_(segment.attention == 0, float("-inf"))[:, None, None, :])
            self.stats.kv_cells += segment.attention.numel()
        self.stats.segments += len(batch.segments)
        input_ids = torch.cat([s.pending for s in batch.segments])
        positions = torch.cat([s.positions for s in batch.segments])
        return input_ids, positions, SegmentedCache(batch.segments, rows, masks), rows

    def decoded(self, batch: RunningBatch, logits: torch.Tensor, rows: list[slice], version: int) -> None:
        """Sample a decode step's tokens (``logits`` of the rows of each segment's ``rows``); advance the rows."""
        context = torch.stack([s.attention.sum() for s in batch.segments]).sum()  # read with the tokens
        tokens, context_cells = self.sample(batch.rows, logits, version, context)
        self.stats.kv_context_cells += int(context_cells)
        for segment, r in zip(batch.segments, rows):
            segment.positions = segment.positions + 1
            segment.pending = tokens[r]
        self.stats.decode_steps += 1

    def fail_past_window(self, batch: RunningBatch) -> None:
        """Fail the requests whose next token would not see its whole context (the masks have no window)."""
        for segment in batch.segments:
            for seq, position in zip(segment.rows, segment.positions.tolist()):
                if not seq.delivered and position >= self.sliding_window:
                    seq.delivered = True
                    error = EngineError(
                        f"request {seq.rid!r} reached the model's sliding attention window ({self.sliding_window} "
                        "tokens), which HFEngine does not implement; serve such contexts with SGLang"
                    )
                    self.outbox.append((seq, error))

    def sample(
        self, rows: list[Submission], logits: torch.Tensor, version: int, counted: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, float]:
        """Each row's next token (a row whose logits are not finite fails); record it on the live rows.

        The tokens, their logprobs, whether each row could be sampled and ``counted`` (a 0-dim count for the
        stats; returned as a float, 0 if None) come to the host in one read; which filters run is decided
        from the requests' `SamplingParams` here, not read from the device."""
        temperature = torch.tensor([s.sampling.temperature for s in rows], dtype=torch.float, device=self.device)
        top_p = torch.tensor([s.sampling.top_p for s in rows], dtype=torch.float, device=self.device)
        top_k = torch.tensor([s.sampling.top_k for s in rows], dtype=torch.long, device=self.device)
        use_top_p = any(np.float32(s.sampling.top_p) < 1 for s in rows)  # as ``top_p`` holds it
        use_top_k = any(s.sampling.top_k > 0 for s in rows)
        draws = seeded_draws([s.sampling.seed for s in rows], [len(s.input_ids) + len(s.tokens) for s in rows])
        u = uniforms(len(rows), logits.device, self.generator, draws)
        args = (temperature, top_p, top_k, u)
        tokens, logprobs, ok = sample_rows(logits, *args, use_top_k=use_top_k, use_top_p=use_top_p)
        count = counted if counted is not None else logits.new_zeros(())
        read = torch.cat([torch.stack([tokens.double(), logprobs.double(), ok.double()]).flatten(), count.reshape(1)])
        values = read.tolist()
        n = len(rows)
        if not all(values[2 * n : 3 * n]):  # rows whose logits are not finite (NaN, inf): those fail, the others go on
            bad = unsampleable(logits, temperature)
            if not bool(bad.any()):
                raise ValueError("sample: rows that cannot be sampled, yet their logits look finite")
            for i in bad.nonzero().squeeze(1).tolist():
                if not rows[i].delivered:
                    self.fail(rows[i], ValueError("its next-token logits are not finite (NaN or inf)"))
            logits = logits.masked_fill(bad[:, None], 0.0)
            tokens, logprobs, _ = sample_rows(logits, *args, use_top_k=use_top_k, use_top_p=use_top_p)
            values[: 2 * n] = tokens.tolist() + logprobs.tolist()
        self.record(rows, [int(t) for t in values[:n]], values[n : 2 * n], version)
        return tokens, values[-1]

    def record(self, rows: list[Submission], tokens: list[int], logprobs: list[float], version: int) -> None:
        """Each live row's sampled token and logprob; a stop token or the length limit ends its request."""
        for seq, tok, lp in zip(rows, tokens, logprobs):
            if seq.delivered:  # a finished row still in the batch: its tokens go nowhere
                continue
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(version)
            if tok in seq.stops:
                seq.stop_reason = "stop"
            elif len(seq.tokens) >= seq.sampling.max_new_tokens:
                seq.stop_reason = "length"
            self.stats.generated_tokens += 1

    def retire(self, batch: RunningBatch) -> None:
        """Hand back finished and aborted rows, drop emptied segments and merge those cheap to merge."""
        for segment in batch.segments:
            self.retire_rows(segment)
        batch.segments = [segment for segment in batch.segments if segment.rows]
        consolidate(batch.segments, self.max_segments)

    def retire_rows(self, segment: Segment) -> None:
        """Hand back a segment's finished and aborted rows, keep their KV for a next turn (`PrefixCache`),
        and `compact` the segment."""
        finished = []
        for i, seq in enumerate(segment.rows):
            if not seq.delivered and (seq.stop_reason is not None or seq.abort):
                self.finish(seq, seq.stop_reason or "abort")
                finished.append(i)
        by_adapter: dict[str | None, list[int]] = {}
        for i in finished if self.prefixes.max_tokens > 0 else []:
            if segment.rows[i].lora_name is None or segment.rows[i].lora_name in self.lora:
                by_adapter.setdefault(segment.rows[i].lora_name, []).append(i)
        for adapter, kept in by_adapter.items():
            # their rows hold context + tokens[:-1]: kept for a next turn (of the same adapter)
            index = torch.tensor(kept, device=self.device)
            self.prefixes.add(
                [layer.keys for layer in segment.cache.layers],
                [layer.values for layer in segment.cache.layers],
                segment.attention[index],
                [tuple(segment.rows[i].input_ids + segment.rows[i].tokens[:-1]) for i in kept],
                adapter,
                rows=index,
            )
        compact(segment)

    def finish(self, seq: Submission, reason: StopReason) -> None:
        """Hand ``seq`` back with its tokens so far, stopped for ``reason``."""
        if reason == "abort":
            self.stats.aborted += 1
        response = GenResponse(seq.tokens, seq.logprobs, seq.versions, reason, time.perf_counter() - seq.start)
        seq.delivered = True
        self.outbox.append((seq, response))  # handed over after the step (`deliver`)

    def fail(self, seq: Submission, error: BaseException) -> None:
        """Hand ``seq`` back with an `EngineError` (its row leaves the batch at the next `retire`)."""
        seq.delivered = True
        self.stats.failed += 1
        failure = EngineError(f"request {seq.rid!r} failed in the engine: {type(error).__name__}: {error}")
        failure.__cause__ = error
        self.outbox.append((seq, failure))


def _sliding_window(model: PreTrainedModel) -> int | None:
    """The model's sliding attention window, if any of its layers has one."""
    window = getattr(model.config, "sliding_window", None)
    layer_types = getattr(model.config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def compiled_decode(step: LlamaDecodeStep | None, max_rows: int):  # noqa: ANN201
    """``step``'s decode step compiled (`CompiledDecode`: imports the compiler, so only when asked); ``step``
    None (another model, or no fast_decode): a `ConfigError`."""
    if step is None:
        raise ConfigError("compile_decode: compiles fast_decode's step, which this model or setting does not run")
    from areal_agents.engines.hf.compiled_decode import CompiledDecode  # noqa: PLC0415

    return CompiledDecode(step, max_rows)
