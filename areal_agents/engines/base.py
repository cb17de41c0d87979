"""The `InferenceEngine` protocol: token ids in, token ids + behavior logprobs + versions out."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from areal_agents.types import GenRequest, GenResponse


@runtime_checkable
class InferenceEngine(Protocol):
    """An interruptible, versioned generator.

    ``pause()`` stops generation at a token boundary (in-flight requests resume later with the new
    weights); ``update_weights`` swaps the policy and bumps the version; every generated token carries
    the version of the weights that produced it. Optional: ``async counters() -> dict[str, float]``, the
    engine's counters since its start (read through `engine_counters`).
    """

    async def agenerate(self, request: GenRequest) -> GenResponse: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None) -> None: ...

    def get_version(self) -> int: ...

    def set_version(self, version: int) -> None: ...


@runtime_checkable
class LoraEngine(InferenceEngine, Protocol):
    """An engine that serves LoRA adapters beside its base model; a request names one by
    ``GenRequest.lora_name`` (None: the base model). Adapters are PEFT's format: a directory with
    ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``) and
    ``adapter_model.safetensors`` (keys as `peft.get_peft_model_state_dict` names them)."""

    async def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> None:
        """Serve the adapter in directory ``path`` as ``name``, replacing one of that name: generation paused,
        the adapter loaded, the engine's version set to ``version`` (None: unchanged), generation resumed."""
        ...

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``; requests naming it are refused afterwards."""
        ...


async def engine_counters(engine: InferenceEngine) -> dict[str, float]:
    """An engine's counters since its start, by name (e.g. ``prefill_tokens``, ``busy_seconds``), from its
    optional ``async counters()`` method; ``{}`` for an engine without one. The RL recipe logs their
    change per step as ``engine/...`` metrics, naming no concrete engine."""
    counters = getattr(engine, "counters", None)
    return dict(await counters()) if counters is not None else {}
