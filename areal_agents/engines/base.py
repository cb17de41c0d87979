"""The `InferenceEngine` protocol: token ids in, token ids + behavior logprobs + versions out."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from areal_agents.types import GenRequest, GenResponse


@runtime_checkable
class InferenceEngine(Protocol):
    """An interruptible, versioned generator.

    ``pause()`` stops generation at a token boundary (in-flight requests resume later with the new
    weights); ``update_weights`` swaps the policy and bumps the version; every generated token carries
    the version of the weights that produced it.
    """

    async def agenerate(self, request: GenRequest) -> GenResponse: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None) -> None: ...

    def get_version(self) -> int: ...

    def set_version(self, version: int) -> None: ...
