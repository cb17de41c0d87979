"""Tinker's ``sample`` on our engine: an adapter snapshot served under a name, n samples with their logprobs.

A `Snapshot` is one adapter's weights at one moment (a sampler is immutable: training on does not change it),
or the bare base. `sample` sends n requests naming the engine's adapter and maps Tinker's sampling params
onto ours: ``top_k=-1`` is off; ``stop=None`` stops at EOS, ``stop=[]`` nowhere (not even EOS), token ids
stop there (and at EOS), strings cut the reply after the token that completes the first one (and EOS stops).
Prompt logprobs, when asked, come from a forward pass of the same snapshot (the caller's ``score``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from areal_agents.engines.base import LoraEngine
from areal_agents.engines.hf.multi_lora import read_adapter_dir
from areal_agents.errors import EngineError, RequestError, TinkerUserError
from areal_agents.types import GenRequest, SamplingParams

MAX_SAMPLES = 128  # num_samples of one request at most


@dataclass(frozen=True)
class Snapshot:
    """An adapter's weights (``tensors`` keyed as PEFT saves them, ``config`` its adapter_config) over the base
    model in ``base_dir``; both None: the bare base."""

    base_dir: str
    tensors: dict[str, torch.Tensor] | None = None
    config: dict[str, Any] | None = None

    @classmethod
    def read(cls, path: str | Path, base_dir: str) -> Snapshot:
        """The snapshot saved in PEFT's adapter directory ``path`` (a checkpoint's or a sampler's)."""
        try:
            tensors, config = read_adapter_dir(path)
        except EngineError as e:
            raise TinkerUserError(f"model_path: {e}") from None
        return cls(base_dir, tensors, config)


class ServedAdapters:
    """The sampler adapters one engine serves: loaded when first sampled, the oldest idle ones let go past
    ``limit``. Loads and unloads take turns (concurrent first samples load once), and an adapter is never let go
    while a sample of it runs (the cap is exceeded instead, until one is idle)."""

    def __init__(self, engine: LoraEngine, limit: int):
        self.engine = engine
        self.limit = limit
        self._running: dict[str, int] = {}  # adapter name -> samples running now; oldest load first
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def use(self, name: str, snapshot: Snapshot) -> AsyncIterator[str | None]:
        """The engine's adapter name for ``snapshot`` (None: the bare base) while the caller samples."""
        if snapshot.tensors is None:
            yield None
            return
        async with self._lock:
            if name not in self._running:
                idle = [n for n, running in self._running.items() if not running]
                for old in idle[: max(0, len(self._running) + 1 - self.limit)]:
                    del self._running[old]
                    await self.engine.unload_lora_adapter(old)
                await self.engine.set_lora_adapter(name, snapshot.tensors, snapshot.config)
                self._running[name] = 0
            self._running[name] += 1
        try:
            yield name
        finally:
            if name in self._running:  # not let go by `drop` meanwhile
                self._running[name] -= 1

    async def drop(self, name: str) -> None:
        """Stop serving ``name`` (its running samples fail); nothing when it is not loaded."""
        async with self._lock:
            if self._running.pop(name, None) is not None:
                await self.engine.unload_lora_adapter(name)

    def names(self) -> list[str]:
        """The adapters loaded now, oldest first."""
        return list(self._running)


@dataclass(frozen=True)
class SampleParams:
    """Tinker's ``sampling_params``: ``top_k=-1`` is off, ``stop`` as the module docstring says."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | Sequence[str] | Sequence[int] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        where = "sampling_params"
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise TinkerUserError(f"{where}.max_tokens: expects an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise TinkerUserError(f"{where}.temperature: expects a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise TinkerUserError(f"{where}.top_p: expects 0 < top_p <= 1, got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise TinkerUserError(f"{where}.top_k: expects -1 (off) or an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise TinkerUserError(f"{where}.seed: expects an integer, got {self.seed!r}")
        stops = self.stops
        if not (all(isinstance(s, str) and s for s in stops) or all(_is_int(s) and s >= 0 for s in stops)):
            raise TinkerUserError(f"{where}.stop: expects a string, a list of strings or of token ids, got {stops!r}")

    @property
    def stops(self) -> list:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def engine_params(self, index: int) -> SamplingParams:
        """Our `SamplingParams` for sample ``index`` (its own seed: seed + index, when a seed is given)."""
        stops = self.stops
        return SamplingParams(
            max_new_tokens=self.max_tokens,
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=max(0, self.top_k),
            stop_token_ids=[s for s in stops if not isinstance(s, str)],
            ignore_eos=self.stop is not None and not stops,
            seed=None if self.seed is None else self.seed + index,
        )


@dataclass
class SampledSequence:
    """One sample: its tokens, their logprobs, and why it ended (``stop`` or ``length``)."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


@dataclass
class SampleOutput:
    """The samples of one request, and the prompt's logprobs when asked (None at position 0)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None


async def sample(
    engine: LoraEngine,
    adapter_name: str | None,
    prompt_tokens: list[int],
    params: SampleParams,
    num_samples: int = 1,
    decode: Callable[[list[int]], str] | None = None,
    score: Callable[[list[int]], list[float | None]] | None = None,
) -> SampleOutput:
    """``num_samples`` samples of ``prompt_tokens`` from adapter ``adapter_name`` on ``engine`` (None: the base);
    ``decode`` turns tokens into text (needed for string stops); ``score`` gives prompt logprobs (None: not asked)."""
    if not _is_int(num_samples) or not 1 <= num_samples <= MAX_SAMPLES:
        raise TinkerUserError(f"num_samples: expects an integer in [1, {MAX_SAMPLES}], got {num_samples!r}")
    if not isinstance(prompt_tokens, list) or not prompt_tokens or not all(_is_int(t) for t in prompt_tokens):
        raise TinkerUserError("prompt: expects at least one token (a list of token ids)")
    requests = [
        GenRequest(f"tinker-{uuid.uuid4().hex}", list(prompt_tokens), params.engine_params(i), lora_name=adapter_name)
        for i in range(num_samples)
    ]
    try:
        responses = await asyncio.gather(*(engine.agenerate(r) for r in requests))
    except RequestError as e:  # the engine names the field (a token out of the vocabulary, a prompt too long)
        raise TinkerUserError(f"prompt: {e}") from None
    strings = [s for s in params.stops if isinstance(s, str)]
    sequences = []
    for r in responses:
        reason = "length" if r.stop_reason == "length" else "stop"
        seq = SampledSequence(list(r.output_tokens), list(r.output_logprobs), reason)
        sequences.append(cut_at_strings(seq, strings, decode) if strings else seq)
    prompt_logprobs = await asyncio.to_thread(score, list(prompt_tokens)) if score is not None else None
    return SampleOutput(sequences, prompt_logprobs)


def cut_at_strings(
    seq: SampledSequence, stops: list[str], decode: Callable[[list[int]], str] | None
) -> SampledSequence:
    """``seq`` up to the token whose text completes the first of ``stops`` (kept, as Tinker does), ``stop``."""
    if decode is None:
        raise TinkerUserError("sampling_params.stop: stop strings need the base model's tokenizer")
    if not any(s in decode(seq.tokens) for s in stops):
        return seq
    for k in range(1, len(seq.tokens) + 1):
        text = decode(seq.tokens[:k])
        if any(s in text for s in stops):
            return SampledSequence(seq.tokens[:k], seq.logprobs[:k], "stop")
    return seq


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
