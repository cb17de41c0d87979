"""`PolicyServing`: each policy's engine, the weight sync that reaches it and the servers behind it, built
from the ``engine`` section the one way both launchers build them (`LocalLauncher`, `RayLauncher`).

A full-weights policy gets an engine of its own: in this process, a client of servers launched here
(`launch_servers`), or of servers its launcher started elsewhere (Ray actors, ``engine.urls``), with the
sync ``engine.weight_sync`` names. LoRA policies share the first one's engine of the base model (a
`LoraGroup`): each sees it through its adapter's view and pushes its adapter by its own `LoraSync`.

    serving = PolicyServing(run_dir, seed=cfg.seed)
    s = serving.open("policy", cfg.engine, cfg.model.path, cfg.model.dtype)
    policy = Policy(..., s.engine, s.sync, s.servers)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from areal_agents.config import EngineConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.local_servers import engine_client, open_engine, open_weight_sync
from areal_agents.engines.lora_sync import LoraGroup
from areal_agents.engines.supervisor import Servers
from areal_agents.engines.weight_sync import WeightSync


@dataclass(frozen=True)
class Serving:
    """A policy's engine, its weight sync, and the servers it stops (None: its engine runs in this process,
    or another policy's servers serve it)."""

    engine: InferenceEngine
    sync: WeightSync
    servers: Servers | None

    def close(self) -> None:
        """Stop what this policy holds: its engine's threads or process, and its servers."""
        self.engine.close()
        if self.servers is not None:
            self.servers.stop()


class PolicyServing:
    """Opens each policy's `Serving`; LoRA policies share the first one's engine (the run's `LoraGroup`)."""

    def __init__(self, run_dir: str | Path, seed: int = 0) -> None:
        self.run_dir, self.seed = Path(run_dir), seed
        self.lora_group: LoraGroup | None = None  # the base model's engine, serving every policy's adapter

    def open(
        self,
        name: str,
        cfg: EngineConfig,
        model_path: str,
        dtype: str,
        *,
        lora: bool = False,
        engine_dir: Path | None = None,
        servers: Callable[[], Servers] | None = None,
    ) -> Serving:
        """Policy ``name``'s serving of ``model_path`` (LoRA: the base model the adapters sit on) in ``dtype``;
        ``engine_dir``: where its servers' logs and pushed weights go (default: the run's directory);
        ``servers``: starts the servers its engine talks to (its launcher's: Ray actors), else `open_engine`."""
        if lora and self.lora_group is not None:
            return Serving(self.lora_group.view(name), self.lora_group.sync(name), None)
        engine, running = self._engine(cfg, model_path, dtype, engine_dir or self.run_dir, servers)
        try:
            if lora:
                self.lora_group = LoraGroup(engine)
                return Serving(self.lora_group.view(name), self.lora_group.sync(name), running)
            return Serving(engine, open_weight_sync(cfg, engine, running, model_path, cfg.dtype), running)
        except BaseException:
            engine.close()
            if running is not None:
                running.stop()
            raise

    def _engine(
        self, cfg: EngineConfig, model_path: str, dtype: str, engine_dir: Path, servers: Callable[[], Servers] | None
    ) -> tuple[InferenceEngine, Servers | None]:
        if servers is None:
            return open_engine(cfg, model_path, dtype, run_dir=engine_dir, seed=self.seed)
        running = servers()
        try:
            return engine_client(cfg, running.addresses, engine_dir / "engine_weights", running.admin_key), running
        except BaseException:
            running.stop()
            raise
