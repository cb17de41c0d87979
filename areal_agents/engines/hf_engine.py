"""`HFEngine`: an in-process transformers engine that batches concurrent requests and can be interrupted.

Concurrent ``agenerate`` calls that arrive together are decoded as one left-padded batch with a KV
cache. ``pause()`` stops the running batch at the next token boundary; its requests come back
``abort`` internally and are resubmitted (prompt + tokens so far) once ``resume()`` is called, so callers
always get complete responses whose tokens carry the version of the weights that produced them.

    engine = HFEngine(load_model("runs/tiny"))
    resp = await engine.agenerate(GenRequest("r1", prompt_ids, SamplingParams(max_new_tokens=8)))
    await engine.update_weights(trainer_model.state_dict())      # pause, load, version += 1, resume
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from areal_agents.engines.sampling import sample_tokens
from areal_agents.types import GenRequest, GenResponse, SamplingParams


@dataclass
class _Pending:
    input_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    future: asyncio.Future


@dataclass
class _Chunk:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = "length"
    version: int = 0


@dataclass
class EngineStats:
    requests: int = 0
    batches: int = 0
    generated_tokens: int = 0
    interrupted_requests: int = 0
    generate_seconds: float = 0.0


class HFEngine:
    """In-process `InferenceEngine` over a transformers causal LM (the CPU default and test engine)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: list[int] | None = None,
        pad_token_id: int | None = None,
        max_batch_size: int = 512,
        seed: int = 0,
        version: int = 0,
    ) -> None:
        self.model = model.eval()
        self.model.requires_grad_(False)
        eos = eos_token_ids if eos_token_ids is not None else model.generation_config.eos_token_id
        self.eos_token_ids = set([eos] if isinstance(eos, int) else (eos or []))
        pad = pad_token_id if pad_token_id is not None else model.config.pad_token_id
        self.pad_token_id = int(pad if pad is not None else 0)
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.stats = EngineStats()
        self._version = version
        self._queue: list[_Pending] = []
        self._interrupt = threading.Event()  # read by the decode thread at token boundaries
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serve_task: asyncio.Task | None = None
        self._current: asyncio.Future | None = None
        self._paused = False

    # ---- protocol ---------------------------------------------------------------------------

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    async def agenerate(self, request: GenRequest) -> GenResponse:
        self._ensure_serving()
        start = time.perf_counter()
        sp = request.sampling
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        self.stats.requests += 1
        while True:  # resubmit prompt + tokens so far after every interruption
            future = asyncio.get_running_loop().create_future()
            remaining = sp.max_new_tokens - len(tokens)
            self._queue.append(_Pending(request.input_ids + tokens, sp, remaining, future))
            self._wakeup.set()
            chunk: _Chunk = await future
            tokens += chunk.tokens
            logprobs += chunk.logprobs
            versions += [chunk.version] * len(chunk.tokens)
            if chunk.stop_reason != "abort":
                break
            self.stats.interrupted_requests += 1
        return GenResponse(tokens, logprobs, versions, chunk.stop_reason, time.perf_counter() - start)

    async def pause(self) -> None:
        """Stop generating at the next token boundary; in-flight requests wait for `resume`."""
        self._ensure_serving()
        self._paused = True
        self._resumed.clear()
        self._interrupt.set()
        if self._current is not None:
            await asyncio.wait([self._current])
        self._interrupt.clear()

    async def resume(self) -> None:
        self._ensure_serving()
        self._paused = False
        self._resumed.set()

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None) -> None:
        """Load new weights between token boundaries and set the version (default: version + 1)."""
        was_paused = self._paused
        if not was_paused:
            await self.pause()
        self.model.load_state_dict(state_dict)
        self._version = self._version + 1 if version is None else version
        if not was_paused:
            await self.resume()

    async def aclose(self) -> None:
        if self._serve_task is not None:
            self._serve_task.cancel()
            await asyncio.gather(self._serve_task, return_exceptions=True)
            self._serve_task = None

    # ---- serving loop -------------------------------------------------------------------------

    def _ensure_serving(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._serve_task is not None and not self._serve_task.done():
            return
        # First use, or a new event loop (e.g. a second asyncio.run): bind fresh primitives to it.
        self._loop = loop
        self._wakeup = asyncio.Event()
        self._resumed = asyncio.Event()
        if not self._paused:
            self._resumed.set()
        self._serve_task = loop.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            await self._resumed.wait()
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            # Let requests that become ready in the same burst join this batch.
            size = -1
            while size != len(self._queue):
                size = len(self._queue)
                for _ in range(3):
                    await asyncio.sleep(0)
            if not self._resumed.is_set():
                continue
            batch, self._queue = self._queue[: self.max_batch_size], self._queue[self.max_batch_size :]
            self._current = asyncio.ensure_future(asyncio.to_thread(self._generate_batch, batch))
            try:
                chunks = await self._current
            except Exception as e:  # a model error fails these requests, not the engine
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            finally:
                self._current = None
            for p, chunk in zip(batch, chunks):
                if not p.future.done():
                    p.future.set_result(chunk)

    # ---- decoding (runs in a worker thread) ---------------------------------------------------

    @torch.inference_mode()
    def _generate_batch(self, batch: list[_Pending]) -> list[_Chunk]:
        start = time.perf_counter()
        version = self._version
        n = len(batch)
        chunks = [_Chunk(version=version) for _ in batch]
        if self._interrupt.is_set():
            for c in chunks:
                c.stop_reason = "abort"
            return chunks
        width = max(len(p.input_ids) for p in batch)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding, so every row's next token sits at the end
            input_ids[i, width - len(p.input_ids) :] = torch.tensor(p.input_ids)
            attention[i, width - len(p.input_ids) :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        temperature = torch.tensor([p.sampling.temperature for p in batch], dtype=torch.float)
        top_p = torch.tensor([p.sampling.top_p for p in batch], dtype=torch.float)
        top_k = torch.tensor([p.sampling.top_k for p in batch], dtype=torch.long)
        stops = [self.eos_token_ids | set(p.sampling.stop_token_ids) for p in batch]

        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        next_pos = positions[:, -1] + 1
        done = [False] * n
        for _ in range(max(p.max_new_tokens for p in batch)):
            tokens, logprobs = sample_tokens(out.logits[:, -1], temperature, top_p, top_k, self.generator)
            for i, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
                if done[i]:
                    continue
                chunks[i].tokens.append(tok)
                chunks[i].logprobs.append(lp)
                if tok in stops[i]:
                    done[i], chunks[i].stop_reason = True, "stop"
                elif len(chunks[i].tokens) >= batch[i].max_new_tokens:
                    done[i], chunks[i].stop_reason = True, "length"
            if all(done):
                break
            if self._interrupt.is_set():
                for i in range(n):
                    if not done[i]:
                        chunks[i].stop_reason = "abort"
                break
            attention = torch.cat([attention, torch.ones((n, 1), dtype=torch.long)], dim=1)
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=attention,
                position_ids=next_pos[:, None],
                cache=out.cache,
                use_cache=True,
            )
            next_pos = next_pos + 1
        self.stats.batches += 1
        self.stats.generated_tokens += sum(len(c.tokens) for c in chunks)
        self.stats.generate_seconds += time.perf_counter() - start
        return chunks
