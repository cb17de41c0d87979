"""`RemoteLora`: the `LoraEngine` half of `RemoteEngine`, LoRA adapters on model servers.

An adapter load is a weight update (`RemoteEngine.swap_weights`): every server in the rotation pauses, loads
the PEFT directory under the adapter's name, names the version, and resumes; requests in flight when an
adapter is replaced are aborted and resubmitted with the new one (`lora_pause_mode`). A subclass says how its
servers' API loads and unloads one (`load_lora_on_servers`, `unload_lora_on_servers`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar, Literal

from areal_agents.errors import ConfigError, EngineError

PauseMode = Literal["abort", "keep"]
# how servers refuse a request naming an adapter they do not serve: vLLM (404), serve-model and SGLang (400)
ADAPTER_MISSING = ("does not exist", "is not loaded", "are not loaded")


class RemoteLora:
    """Adapters on a `RemoteEngine`'s servers (a mixin: it uses the engine's ``swap_weights``, ``stats``,
    ``pause_mode`` and ``name_version_on_servers``); ``adapters`` holds those this client loaded."""

    adapters: dict[str, str]  # LoRA adapters this client loaded: name -> directory
    LORA_LOAD_PATH: ClassVar[str] = "/load_lora_adapter"  # the route that loads one (``lora_name``, ``lora_path``)

    async def load_lora_on_servers(self, name: str, path: str, replace: bool) -> None:
        """Have every (paused) server serve the PEFT adapter in ``path`` as ``name`` (``replace``: this
        client loaded one of that name before). Servers without adapters: an error."""
        raise EngineError(f"{type(self).__name__} does not serve LoRA adapters")

    async def unload_lora_on_servers(self, name: str) -> None:
        """Have every server stop serving adapter ``name``."""
        raise EngineError(f"{type(self).__name__} does not serve LoRA adapters")

    async def set_lora_adapter(
        self, name: str, weights: dict[str, Any], config: dict[str, Any], version: int | None = None
    ) -> None:
        """Servers load adapters from a directory (`load_lora_adapter`), written under ``weights_dir``: one not
        given one has nowhere to put the tensors."""
        raise ConfigError("LoRA on model servers: the engine has no weights directory to write adapters to")

    def lora_pause_mode(self, replace: bool) -> PauseMode:
        """How the servers pause for an adapter load: ``pause_mode``, but ``abort`` to replace one (``replace``),
        whatever ``pause_mode`` says: SGLang unloads a name only once no request uses it, which a request kept
        through the pause never stops doing, and vLLM can serve a kept request its old adapter (see
        `VLLMEngine.load_lora_on_servers`). The requests in flight are resubmitted with the new adapter."""
        return "abort" if replace else self.pause_mode

    async def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> None:
        """Serve the PEFT adapter in directory ``path`` as ``name`` on every server, replacing one of that
        name: as a weight update (`swap_weights`: paused, loaded, ``version`` named, resumed), so requests in
        flight are resubmitted with the new adapter (`lora_pause_mode`); ``version`` None keeps the current one.
        Bytes and seconds of each load are counted in ``stats``
        (``lora_loads``, ``lora_load_bytes``, ``lora_load_seconds``)."""
        size = adapter_bytes(path)
        start = time.perf_counter()
        replace = name in self.adapters

        async def load(v: int) -> None:
            await self.load_lora_on_servers(name, str(path), replace)
            await self.name_version_on_servers(v)

        mode = self.lora_pause_mode(replace)
        await self.swap_weights(load, self.get_version() if version is None else version, mode)
        self.adapters[name] = str(path)
        self.stats["lora_loads"] += 1
        self.stats["lora_load_bytes"] += size
        self.stats["lora_load_seconds"] += time.perf_counter() - start

    async def restore_adapter(self, url: str, name: str | None, error: Exception) -> bool:
        """After server ``url`` refused a request naming adapter ``name`` (``error``) because it does not serve
        it, though this client loaded it (a server restarted since, by the launcher's `Supervisor`, lost the
        adapters loaded at run time): load it there again from its latest directory. Whether it did (the
        request is then sent again)."""
        if name is None or name not in self.adapters or not any(m in str(error) for m in ADAPTER_MISSING):
            return False
        body = {"lora_name": name, "lora_path": self.adapters[name]}
        await self._post(url, self.LORA_LOAD_PATH, body, text=True)
        self.stats["lora_restored"] += 1
        return True

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` on every server; requests naming it are refused afterwards."""
        await self.unload_lora_on_servers(name)
        self.adapters.pop(name, None)


def adapter_bytes(path: str | Path) -> int:
    """The bytes of a PEFT adapter directory's weights (what a sync moves); an error naming the file
    when the directory is not an adapter (no ``adapter_config.json``, or no ``adapter_model.*``)."""
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise EngineError(f"LoRA adapter {path}: no adapter_config.json (expects a PEFT save_pretrained directory)")
    weights = [f for f in path.glob("adapter_model.*") if f.suffix in (".safetensors", ".bin")]
    if not weights:
        raise EngineError(
            f"LoRA adapter {path}: no adapter_model.safetensors (expects a PEFT save_pretrained directory)"
        )
    return sum(f.stat().st_size for f in weights)
