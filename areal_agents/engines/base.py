"""The `InferenceEngine` protocol: token ids in, token ids + behavior logprobs + versions out."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from areal_agents.types import GenRequest, GenResponse


@runtime_checkable
class InferenceEngine(Protocol):
    """An interruptible, versioned generator.

    ``pause()`` stops generation at a token boundary (in-flight requests resume later with the new
    weights); ``update_weights`` swaps the policy and bumps the version; every generated token carries
    the version of the weights that produced it. The members with a body here are defaults, which an engine
    that subclasses the protocol inherits and one that knows better overrides.
    """

    weights_dir: Path | None = None  # where new weights are written for its servers to load; None: none (in process)

    async def agenerate(self, request: GenRequest) -> GenResponse: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None) -> None: ...

    def get_version(self) -> int: ...

    def set_version(self, version: int) -> None: ...

    def max_context(self) -> int | None:
        """The most tokens one sequence (prompt + reply) may hold, when the engine knows it (an in-process model's
        ``max_position_embeddings``); None: unknown here (servers check requests themselves)."""
        return None

    async def counters(self) -> dict[str, float]:
        """The engine's counters since its start, by name (e.g. ``prefill_tokens``, ``busy_seconds``); the RL recipe
        logs their change per step as ``engine/...`` metrics. Empty: it keeps none."""
        return {}

    def close(self) -> None:
        """Stop what it runs without an event loop (a decode thread, an engine process); none by default."""

    async def aclose(self) -> None:
        """Stop it and close its connections; nothing to close by default."""
        self.close()


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

    async def set_lora_adapter(
        self, name: str, weights: dict[str, Any], config: dict[str, Any], version: int | None = None
    ) -> None:
        """Serve an adapter given as tensors in this process (``weights`` keyed as PEFT saves them, ``config`` its
        ``adapter_config.json``) as ``name``, as `load_lora_adapter` does a directory: an engine without a
        ``weights_dir`` takes adapters so."""
        ...
