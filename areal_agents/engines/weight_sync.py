"""Weight sync: how a policy's new weights, and their version, reach the engines that serve it.

A trainer hands over a `WeightSource` (its weights, readable as tensors in this process or written to a
directory); a `WeightSync` moves them to its engines the way those engines load weights, and bumps their
version, so every token generated afterwards carries it. Two implementations today:

=================  =========================================================================================
`InProcessSync`    ``engine.update_weights(state_dict, version)``: an engine in this process (or its own
                   process, fed through shared memory) swaps the tensors (pause, swap, version, resume)
`DiskSync`         the source writes ``weights_dir/vN``; every server loads it (SGLang's and serve-model's
                   ``/update_weights_from_disk``, vLLM's ``/collective_rpc`` ``reload_weights``); older copies
                   are deleted
=================  =========================================================================================

Later transports are one class each, behind the same two methods: an NCCL broadcast from
the trainer's GPUs (``init_weights_update_group`` / ``update_weights_from_distributed``), and LoRA. For
LoRA the source holds one adapter's tensors only and the sync loads them under the adapter's name
(``/load_lora_adapter``); one base model on one engine then serves several trainable adapters, one per
agent: each agent's policy owns its adapter and its own sync over the shared engine.

Example::

    sync = InProcessSync([engine])
    await sync.push(policy)  # policy: a WeightSource; the engine serves the new weights as version + 1
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from areal_agents.engines.base import InferenceEngine


@runtime_checkable
class WeightSource(Protocol):
    """A policy's current weights (the full model, or an adapter), in the form an engine loads."""

    async def tensors(self) -> dict[str, Any]:
        """The weights as a state dict in this process."""
        ...

    async def save_weights(self, path: Path) -> None:
        """Write the weights to the directory ``path`` as ``model.safetensors`` (what servers load)."""
        ...


@runtime_checkable
class WeightSync(Protocol):
    """Moves a `WeightSource`'s weights to a set of engines and tags them with a version."""

    async def push(self, source: WeightSource, version: int | None = None) -> int:
        """Load the source's weights on every engine as ``version`` (default: the current + 1); return it."""
        ...

    async def announce(self, version: int) -> None:
        """Have every engine tag its tokens with ``version`` without new weights (a resumed run's engines
        start at the checkpoint's weights, under their own version)."""
        ...


class InProcessSync:
    """Weights swapped in place by ``engine.update_weights(state_dict, version)``."""

    def __init__(self, engines: Sequence[InferenceEngine]) -> None:
        self.engines = list(engines)

    async def push(self, source: WeightSource, version: int | None = None) -> int:
        version = self.engines[0].get_version() + 1 if version is None else version
        state_dict = await source.tensors()
        for engine in self.engines:
            await engine.update_weights(state_dict, version)  # pause, swap, version, resume
        return version

    async def announce(self, version: int) -> None:
        for engine in self.engines:
            engine.set_version(version)


class DiskEngine(InferenceEngine, Protocol):
    """An engine whose servers load weights from disk (`SGLangEngine`, `VLLMEngine`: a `RemoteEngine`)."""

    def weights_path(self, version: int) -> Path: ...

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None: ...

    def prune_weights(self, version: int) -> None: ...

    async def announce_version(self) -> None: ...


class DiskSync:
    """The source writes the weights of version N under the first engine's ``weights_path(N)``; every
    engine's servers load them; copies older than N - 1 are deleted (a server restarting meanwhile may
    still read N - 1)."""

    def __init__(self, engines: Sequence[DiskEngine]) -> None:
        self.engines = list(engines)

    async def push(self, source: WeightSource, version: int | None = None) -> int:
        version = self.engines[0].get_version() + 1 if version is None else version
        path = self.engines[0].weights_path(version)
        await source.save_weights(path)
        for engine in self.engines:
            await engine.update_weights_from_disk(str(path), version)  # pause, load, version, resume
        self.engines[0].prune_weights(version)
        return version

    async def announce(self, version: int) -> None:
        for engine in self.engines:
            engine.set_version(version)
            await engine.announce_version()  # fresh servers say "default", not the run's version


def write_weights(state_dict: dict[str, Any], path: str | Path) -> None:
    """``state_dict`` as ``path/model.safetensors``: what servers load (SGLang's ``/update_weights_from_disk``,
    vLLM's ``reload_weights``)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    Path(path).mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    save_file(_untie(tensors), str(Path(path) / "model.safetensors"))


def _untie(tensors: dict) -> dict:
    """safetensors refuses shared storage (tied embeddings): give each tensor its own."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out
