"""`EngineStats`: the cumulative counters of an `HFEngine` (``get_stats``, ``counters``, serve-model's /metrics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    """Counters since the engine's start; the RL recipe logs their change per step (``engine/...``).

    stats = await engine.get_stats()
    hit_rate = stats.prefix_hit_tokens / max(stats.prefix_hit_tokens + stats.prefill_tokens, 1)
    """

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
    adapter_updates: int = 0  # LoRA adapters loaded, replaced or unloaded
    max_running: int = 0
    busy_seconds: float = 0.0

    def counters(self) -> dict[str, float]:
        """Every counter as a float, by field name (what `InferenceEngine.counters` gives)."""
        return {name: float(value) for name, value in asdict(self).items()}
