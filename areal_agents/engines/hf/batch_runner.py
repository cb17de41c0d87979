"""`BatchRunner`: one step of `HFEngine`'s running batch on the model (decode thread only).

A step admits arrivals (a prefill, from the longest cached prefix of each context), decodes one token for
every row over all KV cache segments, samples, and retires finished rows into the prefix cache. An error in
one request's prefill, decode step or sampling fails that request alone: a failed batch prefill is redone
row by row, a failed decode step row by row (prefill, then one step alone). Rows may carry LoRA adapters
(`LoraTable`): each forward adds their deltas grouped by adapter, and the prefix cache keys on the adapter.
The next-token logits are float32 whatever the model's dtype (`head_logits`: the head's product upcast).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from areal_agents.engines.hf.decode_step import LlamaDecodeStep, head_logits
from areal_agents.engines.hf.engine_placement import Placement, moved_weights_error, weight_versions
from areal_agents.engines.hf.kv_buffer import GrowingLayer, kv_dtype_of, spare_columns
from areal_agents.engines.hf.multi_lora import LoraRows, LoraTable
from areal_agents.engines.hf.prefix_cache import PrefixCache
from areal_agents.engines.hf.running_batch import (
    RunningBatch,
    Segment,
    SegmentedCache,
    Submission,
    compact,
    consolidate,
)
from areal_agents.engines.hf.sampling import sample_rows, seeded_uniform, uniforms
from areal_agents.engines.hf.stats import EngineStats
from areal_agents.errors import EngineError
from areal_agents.models.logprobs import tempered_log_softmax
from areal_agents.types import GenResponse, StopReason

# Columns one prefill call runs: its attention mask is [rows, 1, chunk, context] rather than [rows, 1, W, W],
# so re-running a long context (a resumed 16K-token answer) costs memory linear in its length.
PREFILL_CHUNK_TOKENS = 2048

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
        placement: Placement | None = None,
        recompute_adapters: bool = True,
    ) -> None:
        self.model, self.stats = model, stats
        self.placement = placement or Placement(model.device, model.dtype, model.dtype)
        self.device = self.placement.device  # of the model, the KV cache, masks, positions and sampling
        # decode steps of Llama-family models run `LlamaDecodeStep` (False, or another model: transformers' forward)
        self.decode_step = LlamaDecodeStep.of(model, self.placement.dtype) if fast_decode else None
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
        if live:
            self.admit(batch, live, version)
        if batch.segments:
            try:
                self.decode(batch, version)
            except Exception:  # noqa: BLE001  (one request's fault must not fail the others)
                self.redecode_alone(batch, version)
            self.retire(batch)
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
        distinct: dict[tuple[str | None, tuple[int, ...]], int] = {}  # (adapter, context)
        owner = [distinct.setdefault((s.lora_name, tuple(s.input_ids + s.tokens)), len(distinct)) for s in rows]
        adapters, contexts = [a for a, _ in distinct], [c for _, c in distinct]
        if self.prefixes.max_tokens > 0:
            self.cache_shared_prompts(rows)
        decode = max(s.sampling.max_new_tokens - len(s.tokens) for s in rows)  # columns the decode steps may add
        cache, attention, positions, logits, order = self.forward(contexts, adapters, decode)
        if len(contexts) < len(rows):  # copies of the rows of identical contexts
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
        """Prefill distinct contexts (each from its longest cached prefix of its LoRA adapter's), rows with the
        most new tokens first: the cache (room for up to ``decode`` more columns), its attention mask, each
        row's last position and last logits, and which context each row is."""
        hits = [self.prefixes.find(c, a) if len(self.prefixes) else None for c, a in zip(contexts, adapters)]
        start = [h.length if h is not None else 0 for h in hits]
        order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]) - start[i], reverse=True)
        hits, start, adapters = [hits[i] for i in order], [start[i] for i in order], [adapters[i] for i in order]
        news = [contexts[i][s:] for i, s in zip(order, start)]
        width = max(len(c) for c in news)
        n = len(contexts)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for i, new in enumerate(news):  # left padding: every row's next token sits at the end
            input_ids[i, width - len(new) :] = torch.tensor(new)
            attention[i, width - len(new) :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0) + torch.tensor(start)[:, None]
        # built on the host, moved once (on CPU `to` is the tensor itself)
        input_ids, attention, positions = (t.to(self.device) for t in (input_ids, attention, positions))
        lora = self.lora.rows_of(adapters, self.device)
        fused = self.decode_step is not None and lora is None
        past, columns = None, width + (max(h.block.mask.shape[1] for h in hits if h) if any(start) else 0)
        spare = min(decode, spare_columns(columns)) if fused else 0  # the decode steps' room, as GrowingLayer's
        if any(start):  # the past in kv_dtype, the prefill in the model's; the fused one writes after it in place
            keys, values, past_mask = self.prefixes.gather(hits, room=width + spare if fused else 0)
            dtype = self.model.dtype
            past = [(k.to(dtype), v.to(dtype)) for k, v in zip(keys, values)]
            attention = torch.cat([past_mask, attention], dim=1)
        if fused:  # the prefill's buffers become the cache's room as they are
            logits, layers = self.decode_step.prefill(input_ids, positions, attention, past, spare)
            cache = DynamicCache()
            cache.layers = [GrowingLayer.over(kv, columns, self.max_batch_size, self.kv_dtype) for kv in layers]
        else:
            cache, logits = self.forward_transformers(input_ids, positions, attention, past, lora)
            cache.layers = [GrowingLayer.adopt(layer, self.max_batch_size, self.kv_dtype) for layer in cache.layers]
        self.stats.prefills += 1
        self.stats.prefill_tokens += sum(len(c) for c in news)
        self.stats.prefix_hit_tokens += sum(start)
        return cache, attention, positions[:, -1], logits, order

    def forward_transformers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None,
        lora: LoraRows | None,
    ) -> tuple[DynamicCache, torch.Tensor]:
        """`forward`'s prefill through transformers' forward (LoRA rows, models `LlamaDecodeStep` does not
        take): the cache and each row's last logits."""
        width = input_ids.shape[1]
        context = attention.shape[1] - width  # cached prefix columns before the new ones
        cache = None if past is None else DynamicCache(ddp_cache_data=past)
        with self.lora.serving(lora):
            for c0 in range(0, width, PREFILL_CHUNK_TOKENS):
                c1 = min(width, c0 + PREFILL_CHUNK_TOKENS)
                out = self.model.get_decoder()(
                    input_ids=input_ids[:, c0:c1],
                    attention_mask=attention[:, : context + c1],
                    position_ids=positions[:, c0:c1],
                    cache=cache,
                    use_cache=True,
                )
                cache = out.cache
            return cache, head_logits(self.model, out.last_hidden_state[:, -1], lora)  # float32

    def decode(self, batch: RunningBatch, version: int) -> None:
        """One token for every row: one forward over all segments, each attending to its own cache."""
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
        cache = SegmentedCache(batch.segments, rows, masks)
        lora = self.lora.rows_of([s.lora_name for s in batch.rows], self.device)
        with self.lora.serving(lora):
            if self.decode_step is not None:
                logits = self.decode_step(input_ids, positions, cache, lora)
            else:
                hidden = self.model.get_decoder()(
                    input_ids=input_ids[:, None],
                    # 4D: used as it is (unused)
                    attention_mask=torch.zeros((start, 1, 1, 1), dtype=self.model.dtype, device=self.device),
                    position_ids=positions[:, None],
                    cache=cache,
                    use_cache=True,
                ).last_hidden_state[:, -1]
                logits = head_logits(self.model, hidden, lora)  # float32
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
        u = uniforms(len(rows), logits.device, self.generator, _seeded_draws(rows))
        args = (temperature, top_p, top_k, u)
        tokens, logprobs, ok = sample_rows(logits, *args, use_top_k=use_top_k, use_top_p=use_top_p)
        count = counted if counted is not None else logits.new_zeros(())
        read = torch.cat([torch.stack([tokens.double(), logprobs.double(), ok.double()]).flatten(), count.reshape(1)])
        values = read.tolist()
        n = len(rows)
        if not all(values[2 * n : 3 * n]):  # rows whose logits are not finite (NaN, inf): those fail, the others go on
            bad = _unsampleable(logits, temperature)
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


def _seeded_draws(rows: list[Submission]) -> torch.Tensor | None:
    """[B] float64: each seeded row's uniform for the token it samples now (`seeded_uniform`), NaN for the others;
    None when no row has a seed."""
    if all(s.sampling.seed is None for s in rows):
        return None
    return torch.tensor(
        [
            math.nan if s.sampling.seed is None else seeded_uniform(s.sampling.seed, len(s.input_ids) + len(s.tokens))
            for s in rows
        ],
        dtype=torch.float64,
    )


def _unsampleable(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[B] rows `sample_tokens` refuses: their temperature-scaled log-probabilities are NaN or all -inf."""
    logprobs = tempered_log_softmax(logits, temperature)
    return torch.isnan(logprobs).any(-1) | ~torch.isfinite(logprobs).any(-1)
