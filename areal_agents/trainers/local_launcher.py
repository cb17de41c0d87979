"""`LocalLauncher`: a run on this machine (``launcher: local``). Each policy trains in a thread of this
process (`Policy`), or as a `RemotePolicy` over pipes (`PipeTransport`) to a process of its own
(``ppo.trainer: process``) or ``ppo.nproc_per_node`` FSDP2 rank processes, and serves through
the configured engine: in this process (weights swapped in place), or launched model servers (weights
through disk). Envs and episodes run in this process too.

Example::

    launcher = LocalLauncher(cfg)
    policy = launcher.open_policy("policy", cfg.model.path, cfg.model.path, TrainSpec.of(cfg, pad_token_id=0))
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from areal_agents.config import EngineConfig, TrainConfig
from areal_agents.config.engine_section import broadcast_gpu_clash
from areal_agents.config.placement import team_threads
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.local_servers import open_engine
from areal_agents.engines.serving import PolicyServing, Serving
from areal_agents.envs.runtime.backends import EnvBackend
from areal_agents.errors import ConfigError
from areal_agents.models.device import resolve_device
from areal_agents.models.loading import load_tokenizer, pad_token_id
from areal_agents.rollout.episodes import EpisodeFn
from areal_agents.trainers.lora import LoraBase
from areal_agents.trainers.policy import SHARED, Policy, load_trainable
from areal_agents.trainers.policy_api import TrainablePolicy, TrainSpec, policy_starts
from areal_agents.trainers.remote_policy import RemotePolicy
from areal_agents.trainers.trainer_process import PipeTransport


class LocalLauncher:
    """A `Launcher` for this machine; reads ``engine``, ``rollout.max_staleness``, ``ppo.trainer``,
    ``ppo.nproc_per_node`` and ``ppo.cpu_threads`` of the config (the rest is the recipe's). It places the
    run on the cores this process may use: `engine_threads` for each engine, `trainer_threads` for the trainer."""

    def __init__(self, cfg: TrainConfig, run_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir if run_dir is not None else cfg.run_dir)
        self.serving = PolicyServing(self.run_dir, cfg.seed)  # LoRA policies share the base model's engine
        self.lora_base: LoraBase | None = None  # the one trained copy of that base, every LoRA policy's adapter on it

    def start(self) -> None:
        """Nothing to acquire: engines start with their policies."""

    def open_policy(self, name: str, model_path: str, init_path: str, spec: TrainSpec) -> TrainablePolicy:
        check_broadcast_placement(self.cfg)  # before any server starts
        spec = replace(spec, cpu_threads=spec.cpu_threads or trainer_threads(self.cfg))
        if spec.lora is not None:
            return self._open_lora_policy(name, model_path, init_path, spec)
        s = self.open_serving(name, model_path)
        try:
            if self.cfg.ppo.nproc_per_node > 1 or self.cfg.ppo.trainer == "process":
                return RemotePolicy(name, spec, s, self._spawn_trainer(name, model_path, init_path, spec))
            return load_trainable(name, spec, model_path, init_path, serving=s)
        except BaseException:
            s.close()  # its decode thread, or an engine process of its own; its servers
            raise

    def open_serving(self, name: str, model_path: str, lora: bool = False) -> Serving:
        """Policy ``name``'s engine serving ``model_path`` (LoRA: the base the adapters sit on), its sync and
        servers; its engine's threads placed beside the trainer's (`engine_threads`)."""
        cfg = lora_serving(self.cfg) if lora else self.cfg
        where = engine_dir(self.run_dir, SHARED if lora else name)  # LoRA: the base model's, shared
        return self.serving.open(name, placed_engine(cfg), model_path, cfg.model.dtype, lora=lora, engine_dir=where)

    def _open_lora_policy(self, name: str, model_path: str, init_path: str, spec: TrainSpec) -> TrainablePolicy:
        """A LoRA policy over the base model ``init_path``, served by the one engine of that base that serves
        every adapter of the run (opened with the first): its adapter goes by `LoraSync`. In a trainer thread its
        adapter sits on the run's one trained base (`LoraBase`); a trainer process or FSDP2 ranks hold their own."""
        s = self.open_serving(name, init_path, lora=True)  # servers: the first policy's, which stops them
        try:
            if self.cfg.ppo.nproc_per_node > 1 or self.cfg.ppo.trainer == "process":  # its own base there
                return RemotePolicy(name, spec, s, self._spawn_trainer(name, model_path, init_path, spec))
            if self.lora_base is None:
                self.lora_base = LoraBase(init_path, spec.dtype)
            return load_trainable(name, spec, model_path, init_path, lora_base=self.lora_base, serving=s)
        except BaseException:
            if s.servers is not None:
                s.servers.stop()
            raise

    def _spawn_trainer(self, name: str, model_path: str, init_path: str, spec: TrainSpec) -> PipeTransport:
        """The trainer in a process of its own, or ``ppo.nproc_per_node`` FSDP2 rank processes."""
        nproc, gpus = self.cfg.ppo.nproc_per_node, list(self.cfg.engine.gpus)
        return PipeTransport.spawn(spec, name, model_path, init_path, nproc, gpus)

    def env_backend(self) -> EnvBackend | None:
        return None  # the config's

    def episode_runner(self, policy: TrainablePolicy) -> EpisodeFn | None:
        return None  # the recipe's agent, in this process

    def stats(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        """Nothing of its own to stop: each policy stops its trainer and servers."""


def check_broadcast_placement(cfg: TrainConfig) -> None:
    """Refuse a weight broadcast NCCL would refuse: a trainer in this process whose device resolves to CUDA
    (``ppo.device`` auto included, which the config's own check cannot know) beside colocated SGLang servers
    (`broadcast_gpu_clash`). A trainer process or ranks hand their weights over on the CPU (gloo): no clash."""
    clash = broadcast_gpu_clash(cfg.engine)
    if clash is None or cfg.ppo.trainer != "thread" or cfg.ppo.nproc_per_node != 1:
        return
    device = resolve_device(cfg.ppo.device)
    if device.type == "cuda":
        raise ConfigError(f"ppo.device={cfg.ppo.device} (the trainer on {device}): {clash}")


def open_policy(name: str, cfg: TrainConfig, model_path: str, init_path: str, run_dir: Path) -> Policy:
    """A `Policy` (or `RemotePolicy`) of the run ``cfg`` and its engine, as `LocalLauncher` opens it."""
    pad = pad_token_id(load_tokenizer(cfg.model.path))
    return LocalLauncher(cfg, run_dir).open_policy(name, model_path, init_path, TrainSpec.of(cfg, pad))


def open_policy_engine(name: str, cfg: TrainConfig, model_path: str, run_dir: Path) -> tuple[InferenceEngine, Any]:
    """The policy's inference engine alone, serving ``model_path``, and the servers behind it (or None), placed
    as a run places it (benchmarks measure it; a run's policies get theirs with a sync: `LocalLauncher`)."""
    where = engine_dir(run_dir, name)
    return open_engine(placed_engine(cfg), model_path, cfg.model.dtype, run_dir=where, seed=cfg.seed)


def engine_dir(run_dir: Path, name: str) -> Path:
    """Where policy ``name``'s servers log and its pushed weights go: the run's directory for the shared
    policy, ``policies/NAME`` for one of several."""
    return run_dir if name == SHARED else run_dir / "policies" / name


def placed_engine(cfg: TrainConfig) -> EngineConfig:
    """The run's engine section with its decode threads placed beside the trainer's (`engine_threads`)."""
    return replace(cfg.engine, cpu_threads=engine_threads(cfg))


def lora_serving(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``engine.max_lora_rank`` and ``engine.max_loras`` taken from its LoRA policies (what
    launched vLLM and SGLang servers are started with), unless set larger."""
    loras = [start.lora for start in policy_starts(cfg).values() if start.lora is not None]
    e = cfg.engine
    rank = max([e.max_lora_rank, *(lora.r for lora in loras)])
    return replace(cfg, engine=replace(e, max_lora_rank=rank, max_loras=max(e.max_loras, len(loras))))


def engine_threads(cfg: TrainConfig) -> int:
    """Intra-op threads of each local CPU engine's decode thread: ``engine.cpu_threads``, or when 0 (auto) one
    beside overlapping updates (max_staleness > 0: the trainer takes the rest), else the cores less the event
    loop's, shared by the engines that decode at once (a synchronous run never decodes during an update)."""
    if cfg.engine.cpu_threads:
        return cfg.engine.cpu_threads
    if cfg.rollout.max_staleness > 0:
        return 1
    return team_threads(sharers=local_engines(cfg) or 1)


def trainer_threads(cfg: TrainConfig) -> int:
    """Intra-op threads of the trainer (thread, process, or all its ranks) when ``ppo.cpu_threads`` is 0
    (auto): the cores less the event loop's, less those of the local CPU engines (in this process, its
    own, or launched serve-model servers) that keep decoding during updates (max_staleness > 0).
    Oversubscribed OpenMP teams wait on each other (docs/benchmarks.md, "CPU threads" and "Threads")."""
    team = team_threads()
    if cfg.rollout.max_staleness == 0:
        return team
    return max(1, team - local_engines(cfg) * engine_threads(cfg))


def local_engines(cfg: TrainConfig) -> int:
    """How many engines decode on this machine's CPU cores beside the trainer: none behind ``engine.urls``
    or SGLang's (GPUs), one in-process hf engine, else each launched server."""
    e = cfg.engine
    if e.urls or e.backend == "sglang":
        return 0
    return e.num_servers if e.backend in ("serve-model", "vllm") else 1
