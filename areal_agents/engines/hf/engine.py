"""`HFEngine`: an in-process transformers engine with continuous batching, interruptible between steps.

Concurrent requests share one running batch: new ones are prefilled between decode steps, finished ones
leave it (the last rows move into their places). Its KV cache is in segments (rows admitted together,
each left-padded to its own width; neighbours merge when padding is cheaper than an attention call), so a
young row does not attend over the padding of the oldest row's length (`SegmentedKV`).
Requests admitted together with the same context (the episodes of a GRPO group) are prefilled once, and a
request that extends a finished one (the next turn of an episode) prefills only its new tokens
(`PrefixCache`). ``pause()`` stops at a step boundary; ``update_weights`` then swaps the weights, which
invalidates the cache, so on ``resume()`` every running sequence is re-prefilled (prompt + tokens so far)
and its later tokens carry the new version (AReaL's interruptible rollout). ``stale_kv="keep"`` keeps the
old weights' keys and values instead (PipelineRL's in-flight weight update): no re-prefill; each token's
recorded logprob is still that of the distribution it was sampled from, which is what decoupled PPO's
behavior policy needs.
Every request is checked first (`check_request`: token ids in the vocabulary, the prompt within the
model's context, ``max_new_tokens`` capped at the context left); an error in one request's prefill, decode
step or sampling fails that request alone. ``health()`` says whether the decode loop itself still runs.
``abort()`` ends requests early with stop reason ``abort`` and the tokens so far (what ``serve-model``'s
/pause_generation and /abort_request do); ``generate_once`` may return such a partial response, while
``agenerate`` resubmits prompt + tokens so far until the request completes, as the SGLang client does.

    engine = HFEngine(load_model("runs/tiny"))
    resp = await engine.agenerate(GenRequest("r1", prompt_ids, SamplingParams(max_new_tokens=8)))
    await engine.update_weights(trainer_model.state_dict())      # pause, load, version += 1, resume
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from areal_agents.engines.hf.decode_step import LlamaDecodeStep
from areal_agents.engines.hf.kv_buffer import GrowingLayer as _GrowingLayer
from areal_agents.engines.hf.kv_buffer import kv_dtype_of
from areal_agents.engines.hf.prefix_cache import PrefixCache
from areal_agents.engines.hf.request_checks import RequestLimits, check_request
from areal_agents.engines.hf.sampling import sample_tokens
from areal_agents.engines.hf.segmented_attention import SEGMENTED_SDPA, SegmentedKV
from areal_agents.errors import EngineError
from areal_agents.types import GenRequest, GenResponse, SamplingParams, StopReason

StaleKV = Literal["recompute", "keep"]  # what new weights do to the KV cache of running and finished requests
ADMISSION_MAX_WAIT_S = 0.05  # the longest an idle engine holds arriving requests back to admit them together
GATHER_FRACTION = 0.125  # a busy batch admits arrivals once they are this share of its live rows, or ...
COMPACT_FRACTION = 0.0625  # drop finished rows from the cache once they are this share of the batch
MAX_SEGMENTS = 8  # KV cache segments of the running batch (each one an attention call per layer) ...
MERGE_CELLS = 256  # ... two segments merge when padding one to the other costs fewer (row x column) cells
STALL_S = 600.0  # seconds a decode step may take before `health` calls the thread stuck


@dataclass
class EngineStats:
    requests: int = 0
    prefills: int = 0
    prefill_tokens: int = 0  # tokens run through the model by prefills (identical contexts count once)
    prefix_hit_tokens: int = 0  # context tokens a prefill took from the prefix cache instead of running them
    decode_steps: int = 0
    generated_tokens: int = 0
    kv_cells: int = 0  # (row x column) cells of the KV cache the decode steps attended over, padding included
    kv_context_cells: int = 0  # ... of which rows' real tokens: their ratio is the padding the segments left
    segments: int = 0  # KV cache segments, summed over decode steps
    aborted: int = 0  # submissions ended early by abort() (agenerate resubmits them)
    failed: int = 0  # requests failed by an error in their own prefill, decode or sampling (the others go on)
    weight_updates: int = 0
    max_running: int = 0
    busy_seconds: float = 0.0


@dataclass(eq=False)
class _Sequence:
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


@dataclass
class _Batch:
    """Rows decoded together (decode thread only): their left-padded KV cache and next input tokens. The
    running batch is a list of them (segments), each as wide as its own rows need (`SegmentedKV`)."""

    rows: list[_Sequence] = field(default_factory=list)
    cache: DynamicCache | None = None
    attention: torch.Tensor | None = None  # [B, L] 1 = real token
    positions: torch.Tensor | None = None  # [B] position of each row's next input
    pending: torch.Tensor | None = None  # [B] sampled, not yet fed


@dataclass
class _Running:
    """The running batch (decode thread only): segments of rows, oldest first (``HFEngine.max_segments``)."""

    segments: list[_Batch] = field(default_factory=list)

    @property
    def rows(self) -> list[_Sequence]:
        return [seq for segment in self.segments for seq in segment.rows]


class _SegmentedCache(DynamicCache):
    """A decode step's cache as the model sees it: ``update`` writes each segment's rows into that
    segment's layer and returns them all as `SegmentedKV`, which `segmented_sdpa` attends to."""

    def __init__(self, segments: list[_Batch], rows: list[slice], masks: list[torch.Tensor]) -> None:
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


class HFEngine:
    """In-process `InferenceEngine` over a transformers causal LM (the CPU default and test engine)."""

    stall_s: float = STALL_S  # `health`: busy this long without finishing a step is stuck

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: list[int] | None = None,
        pad_token_id: int | None = None,
        max_batch_size: int = 256,
        seed: int = 0,
        version: int = 0,
        admission_window_s: float = 0.002,
        num_threads: int | None = None,
        prefix_cache_tokens: int = 65536,
        stale_kv: StaleKV = "recompute",
        gather_steps: int = 3,
        max_segments: int = MAX_SEGMENTS,
        kv_dtype: str | torch.dtype | None = None,
        fast_decode: bool = True,
    ) -> None:
        if stale_kv not in ("recompute", "keep"):
            raise ValueError(f"stale_kv: expects 'recompute' or 'keep', got {stale_kv!r}")
        if max_segments < 1:
            raise ValueError(f"max_segments: expects at least 1, got {max_segments!r}")
        self.model = model.eval()
        self.model.requires_grad_(False)
        attention = model.config._attn_implementation  # noqa: SLF001
        if attention == "sdpa":
            model.set_attn_implementation(SEGMENTED_SDPA)  # the same attention, over a segmented KV cache
        elif attention != SEGMENTED_SDPA:
            raise EngineError(
                f"HFEngine decodes with sdpa attention over a segmented KV cache; the model uses {attention!r}: "
                "load it with attn_implementation='sdpa'"
            )
        # decode steps of Llama-family models run `LlamaDecodeStep` (False, or another model: transformers' forward)
        self._decode_step = LlamaDecodeStep.of(model) if fast_decode else None
        self._sliding_window = _sliding_window(model)  # the segments' masks attend to every column
        self.limits = RequestLimits.of(model)  # every request is checked against them (`check_request`)
        eos = eos_token_ids if eos_token_ids is not None else model.generation_config.eos_token_id
        self.eos_token_ids = set([eos] if isinstance(eos, int) else (eos or []))
        pad = pad_token_id if pad_token_id is not None else model.config.pad_token_id
        self.pad_token_id = int(pad if pad is not None else 0)
        self.max_batch_size = max_batch_size
        self.admission_window_s = admission_window_s
        self.num_threads = num_threads
        self.generator = torch.Generator().manual_seed(seed)
        self.stats = EngineStats()
        self.prefixes = PrefixCache(prefix_cache_tokens)  # finished rows' KV (decode thread only)
        self.stale_kv = stale_kv
        self.gather_steps = gather_steps  # ... after this many decode steps (0: admit at every step)
        self.max_segments = max_segments  # KV cache segments (1: one cache, left-padded to the oldest row)
        self.kv_dtype = kv_dtype_of(kv_dtype, model.dtype)  # of the KV cache decode steps attend to
        self._gathered = 0  # decode steps arrivals have been held back (decode thread only)
        self._version = version
        self._cv = threading.Condition()  # guards everything below, shared with the decode thread
        self._incoming: list[_Sequence] = []
        self._running: list[_Sequence] = []
        self._admitting: list[_Sequence] = []  # taken from the queue by the step in progress
        self._beat = time.monotonic()  # when the decode thread last began or finished a step (`health`)
        self._paused = False
        self._at_boundary = True  # the decode thread is waiting, not touching the model
        self._idle = True  # ... and waiting for work: a submission must wake it
        self._stale_cache = False
        self._flush_prefixes = False
        self._aborts = False  # abort() marked something: hand it back even while paused
        self._closed = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._outbox: list[tuple[_Sequence, GenResponse]] = []  # finished this step (decode thread only)

    # ---- protocol ---------------------------------------------------------------------------

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    async def generate_once(self, request: GenRequest) -> GenResponse:
        """One submission; ends ``abort`` with the tokens so far if `abort` hits it."""
        seq = self._submit(request)
        try:
            return await asyncio.shield(seq.future)
        except asyncio.CancelledError:
            seq.abort = True  # the caller went away: free its row at the next step
            seq.future.add_done_callback(_ignore_outcome)  # nobody waits for it (e.g. "closed" at exit)
            raise

    async def agenerate(self, request: GenRequest) -> GenResponse:
        """Generate to the end (resubmitting after aborts); `RequestError` names a field the model cannot take."""
        start = time.perf_counter()
        request = check_request(request, self.limits)  # max_new_tokens capped at the context left
        sp = request.sampling
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:  # resubmit prompt + tokens so far after every abort
            remaining = SamplingParams(**{**sp.__dict__, "max_new_tokens": sp.max_new_tokens - len(tokens)})
            part = await self.generate_once(GenRequest(request.rid, request.input_ids + tokens, remaining))
            tokens += part.output_tokens
            logprobs += part.output_logprobs
            versions += part.output_versions
            if part.stop_reason != "abort" or len(tokens) >= sp.max_new_tokens:
                reason = part.stop_reason if part.stop_reason != "abort" else "length"
                return GenResponse(tokens, logprobs, versions, reason, time.perf_counter() - start)
            await self._wait_unpaused()

    async def pause(self) -> None:
        """Stop at the next step boundary; running requests keep their place and continue on `resume`."""
        with self._cv:
            self._paused = True
            self._cv.notify_all()
        await asyncio.to_thread(self._wait_for_boundary)

    async def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    async def abort(self, rid: str | None = None) -> int:
        """End queued and running requests (all, or those whose rid is ``rid``) now, as ``abort``."""
        with self._cv:
            hit = [s for s in self._incoming + self._admitting + self._running if rid is None or s.rid == rid]
            for seq in hit:
                seq.abort = True
            self._aborts = bool(hit)
            self._cv.notify_all()
        return len(hit)

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None) -> None:
        """Load new weights at a step boundary and set the version (default: version + 1)."""
        await self._swap_weights(lambda: self.model.load_state_dict(state_dict), version)

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None:
        """Load the weights of a saved checkpoint (a `save_pretrained` directory) in place."""
        from safetensors.torch import load_file  # noqa: PLC0415  (only this path needs it)

        def load() -> None:
            files = sorted(Path(model_path).glob("*.safetensors"))
            if not files:
                raise EngineError(f"update_weights_from_disk: no *.safetensors in {model_path!r}")
            state: dict[str, torch.Tensor] = {}
            for f in files:
                state.update(load_file(str(f)))
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
                raise EngineError(
                    f"update_weights_from_disk: {model_path!r} does not match the served model "
                    f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
                )
            if self.model.config.tie_word_embeddings:
                self.model.tie_weights()

        await self._swap_weights(load, version)

    async def aclose(self) -> None:
        self.close()

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the decode thread; requests still queued or running fail with `EngineError`. With
        ``timeout_s``, a decode thread stuck in a step is left behind (a daemon) and its requests fail now."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is None:
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            with self._cv:
                stuck, self._incoming = self._incoming + self._admitting + self._running, []
            _deliver([(seq, EngineError("HFEngine is closed (its decode thread did not stop)")) for seq in stuck])

    def health(self) -> str | None:
        """None while the engine can serve; else why not (closed, its decode thread failed or is gone, or
        busy for ``stall_s`` without finishing a step): serve-model's /health answers 503 with it."""
        with self._cv:
            if self._error is not None:
                return f"HFEngine decode thread failed: {self._error!r}"
            if self._closed:
                return "HFEngine is closed"
            if self._thread is not None and not self._thread.is_alive():
                return "HFEngine decode thread is gone"
            if not self._idle and time.monotonic() - self._beat > self.stall_s:
                return f"HFEngine decode thread has not finished a step for {time.monotonic() - self._beat:.0f}s"
        return None

    async def get_stats(self) -> EngineStats:
        """Counters since the start (as `ProcessEngine.get_stats`, which asks its process)."""
        return self.stats

    def flush_cache(self) -> None:
        """Forget the finished requests' cached prefixes (at the next step; new weights do this themselves)."""
        with self._cv:
            self._flush_prefixes = True

    @property
    def num_running(self) -> int:
        """Requests in the running batch whose caller is still waiting."""
        with self._cv:
            return sum(not seq.future.done() for seq in self._running)

    # ---- caller side ------------------------------------------------------------------------

    def _submit(self, request: GenRequest) -> _Sequence:
        request = check_request(request, self.limits)  # nothing the model cannot take reaches the decode thread
        stops = (set() if request.sampling.ignore_eos else self.eos_token_ids) | set(request.sampling.stop_token_ids)
        future = asyncio.get_running_loop().create_future()
        seq = _Sequence(request.rid, list(request.input_ids), request.sampling, stops, future)
        with self._cv:
            if self._closed:
                raise EngineError("HFEngine is closed")
            if self._error is not None:
                raise EngineError(f"HFEngine decode thread failed: {self._error!r}")
            self._incoming.append(seq)
            self.stats.requests += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._decode_loop, name="hf-engine", daemon=True)
                self._thread.start()
            if self._idle:  # a busy decode thread looks at the queue every step: no wake-up (and GIL hand-off) needed
                self._cv.notify_all()
        return seq

    async def _swap_weights(self, load, version: int | None) -> None:
        was_paused = self._paused
        await self.pause()
        try:
            with torch.no_grad():
                load()
            with self._cv:
                self._version = self._version + 1 if version is None else version
                self._stale_cache = self.stale_kv == "recompute"
                self.stats.weight_updates += 1
        finally:
            if not was_paused:
                await self.resume()

    def _await_arrivals(self) -> None:
        """Idle engine, requests arriving: admit them together once they stop coming (a gap of
        ``admission_window_s``, at most `ADMISSION_MAX_WAIT_S`). One prefill then serves a whole
        batch of episodes, instead of many small ones fighting the submitting thread for the GIL."""
        deadline = time.perf_counter() + ADMISSION_MAX_WAIT_S
        seen = -1
        while seen != len(self._incoming) < self.max_batch_size and not (self._paused or self._closed or self._aborts):
            seen = len(self._incoming)
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or self.admission_window_s <= 0:
                return
            self._cv.wait(min(self.admission_window_s, remaining))

    def _gathering(self, batch: _Running, aborts: bool) -> bool:
        """Hold a few arrivals back while a busy batch decodes: every admission is a prefill pass of its own,
        whose fixed cost the whole batch waits for, so fewer, larger admissions cost less (multi-turn
        episodes send their next turns one by one)."""
        live = sum(not s.delivered for s in batch.rows) if self._incoming and not aborts else 0
        if live and len(self._incoming) < GATHER_FRACTION * live and self._gathered < self.gather_steps:
            self._gathered += 1
            return True
        self._gathered = 0
        return False

    def _wait_for_boundary(self) -> None:
        with self._cv:
            while not (self._at_boundary or self._closed) and self._thread is not None and self._thread.is_alive():
                self._cv.wait(0.1)

    async def _wait_unpaused(self) -> None:
        while self._paused and not self._closed:
            await asyncio.sleep(0.005)

    # ---- decode thread ----------------------------------------------------------------------

    def _decode_loop(self) -> None:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)  # this thread's OpenMP team only
        batch = _Running()
        try:
            while True:
                with self._cv:
                    while (
                        not self._closed and not self._aborts and (self._paused or not (batch.rows or self._incoming))
                    ):
                        self._at_boundary = self._idle = True
                        self._cv.notify_all()
                        self._cv.wait()
                    self._idle, self._beat = False, time.monotonic()
                    if self._closed:
                        break
                    if not batch.rows:
                        self._await_arrivals()
                    aborts, self._aborts = self._aborts, False
                    if self._paused:  # only aborts to hand back; the model stays untouched
                        incoming = [s for s in self._incoming if s.abort]
                        self._incoming = [s for s in self._incoming if not s.abort]
                    else:
                        self._at_boundary = False
                        room = 0 if self._gathering(batch, aborts) else self.max_batch_size - len(batch.rows)
                        incoming, self._incoming = self._incoming[:room], self._incoming[room:]
                    stale, self._stale_cache = (
                        (False, self._stale_cache) if self._paused else (self._stale_cache, False)
                    )
                    paused, version, self._admitting = self._paused, self._version, incoming
                    flush, self._flush_prefixes = self._flush_prefixes, False
                if flush:
                    self.prefixes.clear()
                if paused:
                    for seq in incoming:
                        self._finish(seq, "abort")
                    self._retire(batch)
                else:
                    self._step(batch, incoming, stale, version)
                _deliver(self._outbox)
                self._outbox = []
                with self._cv:
                    self._running = [s for s in batch.rows if not s.delivered]
                    self._admitting, self._beat = [], time.monotonic()
        except BaseException as e:  # noqa: BLE001  (fail the requests, not silently hang them)
            self._error = e
        with self._cv:
            self._at_boundary = True
            leftover = batch.rows + self._admitting + self._incoming  # every request this engine took is answered
            self._incoming, self._running, self._admitting = [], [], []
            self._cv.notify_all()
        error = EngineError(f"HFEngine stopped: {self._error!r}" if self._error else "HFEngine is closed")
        _deliver(self._outbox + [(seq, error) for seq in leftover])
        self._outbox = []

    @torch.inference_mode()
    def _step(self, batch: _Running, incoming: list[_Sequence], stale: bool, version: int) -> None:
        """Admit (and re-prefill after a weight swap), then one decode step; retire finished rows."""
        start = time.perf_counter()
        live = [s for s in incoming if not s.abort]
        for seq in incoming:
            if seq.abort:
                self._finish(seq, "abort")
        if stale:
            self.prefixes.clear()
        if stale and batch.segments:  # the cache holds the old weights' keys and values
            live = [s for s in batch.rows if not s.delivered] + live
            batch.segments = []
        if live:
            self._admit(batch, live, version)
        if batch.segments:
            try:
                self._decode(batch, version)
            except Exception:  # noqa: BLE001  (one request's fault must not fail the others)
                self._redecode_alone(batch, version)
            self._retire(batch)
        self.stats.max_running = max(self.stats.max_running, sum(not s.delivered for s in batch.rows))
        self.stats.busy_seconds += time.perf_counter() - start

    def _admit(self, batch: _Running, rows: list[_Sequence], version: int) -> None:
        """Prefill ``rows`` into the running batch (a segment of their own, or merged by `_retire`); if that
        fails, each row alone, so that only the rows whose own prefill fails fail."""
        try:
            batch.segments.append(self._prefill(rows, version))
        except Exception as e:  # noqa: BLE001
            if len(rows) == 1:
                self._fail(rows[0], e)
            else:
                for seq in rows:
                    self._admit(batch, [seq], version)
        self._retire(batch)

    def _redecode_alone(self, batch: _Running, version: int) -> None:
        """A decode step failed (its cache is now unusable): redo it row by row (prefill, then one decode
        step of that row alone); the rows that fail alone fail with their error, the others go on."""
        rows = [s for s in batch.rows if not s.delivered]
        batch.segments = []
        for seq in rows:
            alone = _Running()
            try:
                alone.segments.append(self._prefill([seq], version))
                self._retire(alone)  # a row the prefill's token finished does not decode again
                if alone.segments:
                    self._decode(alone, version)
            except Exception as e:  # noqa: BLE001
                self._fail(seq, e)
                continue
            batch.segments += alone.segments

    def _fail(self, seq: _Sequence, error: BaseException) -> None:
        """Hand ``seq`` back with an `EngineError` (its row leaves the batch at the next `_retire`)."""
        seq.delivered = True
        self.stats.failed += 1
        failure = EngineError(f"request {seq.rid!r} failed in the engine: {type(error).__name__}: {error}")
        failure.__cause__ = error
        self._outbox.append((seq, failure))

    def _prefill(self, rows: list[_Sequence], version: int) -> _Batch:
        """Run the rows' contexts through the model; identical ones (a GRPO group's prompt) run once and
        their cache rows are copied, so a group of G costs one prompt's compute, not G. A context that
        extends a finished request's (the next turn of an episode) runs only its new tokens, and so do
        resumed rows of one group after a weight swap (their prompt runs once)."""
        distinct: dict[tuple[int, ...], int] = {}
        owner = torch.tensor([distinct.setdefault(tuple(s.input_ids + s.tokens), len(distinct)) for s in rows])
        contexts = list(distinct)
        if self.prefixes.max_tokens > 0:
            self._cache_shared_prompts(rows)
        cache, attention, positions, logits = self._forward(contexts)
        if len(contexts) < len(rows):
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[owner], layer.values[owner]
            attention, positions, logits = attention[owner], positions[owner], logits[owner]
        pending = self._sample(rows, logits, version)
        return _Batch(rows, cache, attention, positions + 1, pending)

    def _cache_shared_prompts(self, rows: list[_Sequence]) -> None:
        """Rows that run their own tokens again (resumed after a weight swap) but share a prompt (a GRPO
        group): run each such prompt once into the prefix cache, so that every row runs only its tokens."""
        tails: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
        for seq in rows:
            if seq.tokens:
                tails.setdefault(tuple(seq.input_ids), set()).add(tuple(seq.tokens))
        prompts = []
        for prompt, ends in tails.items():
            hit = self.prefixes.find(prompt + next(iter(ends))) if len(self.prefixes) else None
            if len(ends) > 1 and (hit is None or hit.length < len(prompt)):
                prompts.append(prompt)
        if prompts:
            cache, attention, _, _ = self._forward(prompts)
            self.prefixes.add(
                [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers], attention, prompts
            )

    def _forward(
        self, contexts: list[tuple[int, ...]]
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill distinct contexts (each from its longest cached prefix): the cache, its attention mask,
        each row's last position and last logits."""
        hits = [self.prefixes.find(c) for c in contexts] if len(self.prefixes) else [None] * len(contexts)
        start = [h.length if h is not None else 0 for h in hits]
        news = [c[s:] for c, s in zip(contexts, start)]
        width = max(len(c) for c in news)
        n = len(contexts)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for i, new in enumerate(news):  # left padding: every row's next token sits at the end
            input_ids[i, width - len(new) :] = torch.tensor(new)
            attention[i, width - len(new) :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0) + torch.tensor(start)[:, None]
        past = None
        if any(start):
            keys, values, past_mask = self.prefixes.gather(hits)  # in kv_dtype: the prefill runs in the model's
            dtype = self.model.dtype
            past = DynamicCache(ddp_cache_data=[(k.to(dtype), v.to(dtype)) for k, v in zip(keys, values)])
            attention = torch.cat([past_mask, attention], dim=1)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            cache=past,
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats.prefills += 1
        self.stats.prefill_tokens += sum(len(c) for c in news)
        self.stats.prefix_hit_tokens += sum(start)
        cache = out.cache
        cache.layers = [_GrowingLayer.adopt(layer, self.max_batch_size, self.kv_dtype) for layer in cache.layers]
        return cache, attention, positions[:, -1], out.logits[:, -1]

    def _decode(self, batch: _Running, version: int) -> None:
        """One token for every row: one forward over all segments, each attending to its own cache."""
        if self._sliding_window is not None:
            self._fail_past_window(batch)
        rows, masks, start = [], [], 0
        for segment in batch.segments:
            n = len(segment.rows)
            segment.attention = torch.cat([segment.attention, torch.ones((n, 1), dtype=torch.long)], dim=1)
            rows.append(slice(start, start + n))
            start += n
            bias = torch.zeros(segment.attention.shape, dtype=self.kv_dtype)
            masks.append(bias.masked_fill_(segment.attention == 0, float("-inf"))[:, None, None, :])
            self.stats.kv_cells += segment.attention.numel()
            self.stats.kv_context_cells += int(segment.attention.sum())
        self.stats.segments += len(batch.segments)
        input_ids = torch.cat([s.pending for s in batch.segments])
        positions = torch.cat([s.positions for s in batch.segments])
        cache = _SegmentedCache(batch.segments, rows, masks)
        if self._decode_step is not None:
            logits = self._decode_step(input_ids, positions, cache)
        else:
            logits = self.model(
                input_ids=input_ids[:, None],
                attention_mask=torch.zeros((start, 1, 1, 1), dtype=self.model.dtype),  # 4D: used as it is (unused)
                position_ids=positions[:, None],
                cache=cache,
                use_cache=True,
            ).logits[:, -1]
        tokens = self._sample(batch.rows, logits, version)
        for segment, r in zip(batch.segments, rows):
            segment.positions = segment.positions + 1
            segment.pending = tokens[r]
        self.stats.decode_steps += 1

    def _fail_past_window(self, batch: _Running) -> None:
        """Fail the requests whose next token would not see its whole context (the masks have no window)."""
        for segment in batch.segments:
            for seq, position in zip(segment.rows, segment.positions.tolist()):
                if not seq.delivered and position >= self._sliding_window:
                    seq.delivered = True
                    error = EngineError(
                        f"request {seq.rid!r} reached the model's sliding attention window ({self._sliding_window} "
                        "tokens), which HFEngine does not implement; serve such contexts with SGLang"
                    )
                    self._outbox.append((seq, error))

    def _sample(self, rows: list[_Sequence], logits: torch.Tensor, version: int) -> torch.Tensor:
        temperature = torch.tensor([s.sampling.temperature for s in rows], dtype=torch.float)
        top_p = torch.tensor([s.sampling.top_p for s in rows], dtype=torch.float)
        top_k = torch.tensor([s.sampling.top_k for s in rows], dtype=torch.long)
        try:
            tokens, logprobs = sample_tokens(logits, temperature, top_p, top_k, self.generator)
        except ValueError:  # rows whose logits are not finite (NaN, inf): those requests fail, the others go on
            bad = _unsampleable(logits, temperature)
            if not bool(bad.any()):
                raise
            for i in bad.nonzero().squeeze(1).tolist():
                if not rows[i].delivered:
                    self._fail(rows[i], ValueError("its next-token logits are not finite (NaN or inf)"))
            logits = logits.masked_fill(bad[:, None], 0.0)
            tokens, logprobs = sample_tokens(logits, temperature, top_p, top_k, self.generator)
        for seq, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist()):
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
        return tokens

    def _merge(self, batch: _Batch, new: _Batch) -> None:
        """Append ``new``'s rows to ``batch``'s, left-padding the shorter cache to the same length."""
        if not batch.rows:
            batch.rows, batch.cache, batch.attention = new.rows, new.cache, new.attention
            batch.positions, batch.pending = new.positions, new.pending
            return
        width = max(batch.attention.shape[1], new.attention.shape[1])
        for old_layer, new_layer in zip(batch.cache.layers, new.cache.layers):
            old_layer.add_rows(new_layer.keys, new_layer.values)
        batch.attention = torch.cat(
            [
                F.pad(batch.attention, (width - batch.attention.shape[1], 0)),
                F.pad(new.attention, (width - new.attention.shape[1], 0)),
            ]
        )
        batch.rows = batch.rows + new.rows
        batch.positions = torch.cat([batch.positions, new.positions])
        batch.pending = torch.cat([batch.pending, new.pending])

    def _retire(self, batch: _Running) -> None:
        """Hand back finished and aborted rows, drop emptied segments and merge those cheap to merge."""
        for segment in batch.segments:
            self._retire_rows(segment)
        batch.segments = [segment for segment in batch.segments if segment.rows]
        self._consolidate(batch.segments)

    def _consolidate(self, segments: list[_Batch]) -> None:
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
            if costs[i] >= MERGE_CELLS and len(segments) <= self.max_segments:
                return
            wide, narrow = sorted(segments[i : i + 2], key=lambda segment: -segment.attention.shape[1])
            self._merge(wide, narrow)
            segments[i : i + 2] = [wide]

    def _retire_rows(self, batch: _Batch) -> None:
        """Hand back a segment's finished and aborted rows. Their rows leave the cache (with any all-padding
        columns) once they are `COMPACT_FRACTION` of the segment: the last live rows move into their places."""
        keep, finished = [], []
        for i, seq in enumerate(batch.rows):
            if not seq.delivered and (seq.stop_reason is not None or seq.abort):
                self._finish(seq, seq.stop_reason or "abort")
                finished.append(i)
            if not seq.delivered:
                keep.append(i)
        if finished and self.prefixes.max_tokens > 0:
            index = torch.tensor(finished)  # their rows hold context + tokens[:-1]: kept for a next turn
            self.prefixes.add(
                [layer.keys[index] for layer in batch.cache.layers],
                [layer.values[index] for layer in batch.cache.layers],
                batch.attention[index],
                [tuple(batch.rows[i].input_ids + batch.rows[i].tokens[:-1]) for i in finished],
            )
        if len(batch.rows) - len(keep) <= COMPACT_FRACTION * len(batch.rows) and keep:
            return
        if not keep:
            batch.rows, batch.cache = [], None
            return
        n = len(keep)
        holes = [i for i in range(n) if batch.rows[i].delivered]
        movers = [i for i in keep if i >= n]  # as many as there are holes
        order = list(range(n))
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        index = torch.tensor(order)
        batch.rows = [batch.rows[i] for i in order]
        batch.attention, batch.positions, batch.pending = (
            batch.attention[index],
            batch.positions[index],
            batch.pending[index],
        )
        first = int(batch.attention.any(0).nonzero()[0])  # leading columns nobody attends to any more
        batch.attention = batch.attention[:, first:]
        holes_t, movers_t = torch.tensor(holes, dtype=torch.long), torch.tensor(movers, dtype=torch.long)
        for layer in batch.cache.layers:
            layer.keep_rows(holes_t, movers_t, n, first)

    def _finish(self, seq: _Sequence, reason: StopReason) -> None:
        if reason == "abort":
            self.stats.aborted += 1
        response = GenResponse(seq.tokens, seq.logprobs, seq.versions, reason, time.perf_counter() - seq.start)
        seq.delivered = True
        self._outbox.append((seq, response))  # handed over after the step (`_deliver`)


def _sliding_window(model: PreTrainedModel) -> int | None:
    """The model's sliding attention window, if any of its layers has one."""
    window = getattr(model.config, "sliding_window", None)
    layer_types = getattr(model.config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def _unsampleable(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[B] rows `sample_tokens` refuses: their temperature-scaled log-probabilities are NaN or all -inf."""
    scale = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
    logprobs = torch.log_softmax(logits.float() / scale[:, None], dim=-1)
    return torch.isnan(logprobs).any(-1) | ~torch.isfinite(logprobs).any(-1)


def _ignore_outcome(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: no "exception was never retrieved" at exit


def _deliver(results: list[tuple[_Sequence, GenResponse | BaseException]]) -> None:
    """Settle the callers' futures: one wake-up of each caller's event loop for the lot."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Sequence, GenResponse | BaseException]]] = {}
    for seq, result in results:
        by_loop.setdefault(seq.future.get_loop(), []).append((seq, result))

    def settle(items: list[tuple[_Sequence, GenResponse | BaseException]]) -> None:
        for seq, result in items:
            if seq.future.done():
                continue
            if isinstance(result, BaseException):
                seq.future.set_exception(result)
            else:
                seq.future.set_result(result)

    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(settle, items)
        except RuntimeError:  # the caller's event loop is gone: nobody is waiting
            pass
