"""`Policy`: one trained model with what trains it (optimizer, schedule, critic, reference) and serves it
(its inference engine). A run has one shared policy, or one per agent id (``policies`` in the config)."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from areal_agents.config import TrainConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.local_servers import open_engine
from areal_agents.errors import ConfigError
from areal_agents.models.loading import load_model
from areal_agents.trainers.critic import ValueModel
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.optim import make_optimizer
from areal_agents.trainers.ppo import StreamedUpdate, ppo_update
from areal_agents.types import Trajectory

SHARED = "policy"  # the name of the one policy of a run without separate policies

DEFAULT_CPU_THREADS = torch.get_num_threads()  # torch's intra-op default in this process (all cores)


@dataclass
class Policy:
    name: str
    model: PreTrainedModel  # the trainer's copy
    engine: InferenceEngine | None  # the rollout copy (in-process, or servers behind a client); None on a trainer rank
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: PreTrainedModel | None = None  # frozen initial policy, for ppo.kl_coef
    critic: ValueModel | None = None  # ppo.advantage=gae
    critic_optimizer: torch.optim.Optimizer | None = None
    servers: Any = None  # launched model servers, stopped at the end
    trainer: ThreadPoolExecutor | None = None  # the one thread its updates run on (see `update`)
    streamed: StreamedUpdate | None = None  # the update being fed in parts (`update_part`), if any

    def close(self) -> None:
        """Stop its trainer thread (launched model servers are stopped by whoever launched them)."""
        if self.trainer is not None:
            self.trainer.shutdown()

    def train_state(self) -> dict[str, Any]:
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.critic is not None:
            state |= {"critic": self.critic.state_dict(), "critic_optimizer": self.critic_optimizer.state_dict()}
        return state

    def load_train_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None:
            if "critic" not in state:
                raise ConfigError("--resume: ppo.advantage=gae but the checkpoint holds no critic")
            self.critic.load_state_dict(state["critic"])
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])

    async def update(
        self, trajectories: list[Trajectory], cfg: TrainConfig, pad_token_id: int, generator: torch.Generator
    ) -> dict[str, float]:
        """One PPO update in the policy's trainer thread (rollouts keep running on the event loop).

        Always the same thread, with ``ppo.cpu_threads`` intra-op threads: torch's OpenMP workers belong
        to the thread that starts them, and every extra set competes for the same cores (updates hopping
        between pool threads, beside the engine's and the event loop's, ran slower)."""
        step = functools.partial(self.train_step, trajectories, cfg, pad_token_id, generator)
        return await self._in_trainer(step, cfg)

    async def update_part(self, trajectories: list[Trajectory], cfg: TrainConfig, pad_token_id: int) -> None:
        """Forward and backward on part of a batch (whole groups) in the trainer thread; `finish_update`
        steps. The rollout loop feeds a batch's groups as they finish (``ppo.stream_updates``)."""
        await self._in_trainer(functools.partial(self.train_part, trajectories, cfg, pad_token_id), cfg)

    async def finish_update(self, cfg: TrainConfig, pad_token_id: int, generator: torch.Generator) -> dict[str, float]:
        """The optimizer step of the parts fed so far (none: a skipped step, as `update` of no data); its stats."""
        return await self._in_trainer(functools.partial(self.finish_step, cfg, pad_token_id, generator), cfg)

    async def _in_trainer(self, call: functools.partial, cfg: TrainConfig) -> Any:
        if self.trainer is None:
            threads = cfg.ppo.cpu_threads or trainer_threads(cfg)
            self.trainer = ThreadPoolExecutor(
                1, f"trainer-{self.name}", initializer=torch.set_num_threads, initargs=(threads,)
            )
        return await asyncio.get_running_loop().run_in_executor(self.trainer, call)

    def train_part(self, trajectories: list[Trajectory], cfg: TrainConfig, pad_token_id: int) -> None:
        """`StreamedUpdate.add` (the first part of a batch starts the update)."""
        if self.streamed is None:
            self.streamed = StreamedUpdate(
                self.model,
                self.optimizer,
                self.scheduler,
                cfg.ppo,
                temperature=cfg.rollout.temperature,
                pad_token_id=pad_token_id,
                ref_model=self.reference,
            )
        self.streamed.add(trajectories)

    def finish_step(self, cfg: TrainConfig, pad_token_id: int, generator: torch.Generator) -> dict[str, float]:
        """`StreamedUpdate.finish` of the parts fed since the last step."""
        if self.streamed is None:
            self.train_part([], cfg, pad_token_id)
        update, self.streamed = self.streamed, None
        return update.finish(generator)

    def train_step(
        self,
        trajectories: list[Trajectory],
        cfg: TrainConfig,
        pad_token_id: int,
        generator: torch.Generator,
        dp: DataParallel | None = None,
    ) -> dict[str, float]:
        """One PPO update (``dp``: as one rank of a data-parallel group)."""
        return ppo_update(
            self.model,
            self.optimizer,
            self.scheduler,
            trajectories,
            cfg.ppo,
            temperature=cfg.rollout.temperature,
            pad_token_id=pad_token_id,
            generator=generator,
            ref_model=self.reference,
            critic=self.critic,
            critic_optimizer=self.critic_optimizer,
            dp=dp,
        )

    def remote_train_step(
        self,
        trajectories: list[Trajectory],
        cfg: TrainConfig,
        pad_token_id: int,
        generator_state: torch.Tensor,
        dp: DataParallel | None = None,
    ) -> tuple[dict[str, float], torch.Tensor]:
        """`train_step` where the caller's generator lives in another process: its state in, its state out."""
        return _with_generator(generator_state, lambda g: self.train_step(trajectories, cfg, pad_token_id, g, dp))

    def remote_finish_step(
        self, cfg: TrainConfig, pad_token_id: int, generator_state: torch.Tensor
    ) -> tuple[dict[str, float], torch.Tensor]:
        """`finish_step` where the caller's generator lives in another process: its state in, its state out."""
        return _with_generator(generator_state, lambda g: self.finish_step(cfg, pad_token_id, g))

    async def push_weights(self) -> None:
        await self.engine.update_weights(self.model.state_dict())  # pause, swap, version + 1, resume


def _with_generator(state: torch.Tensor, call: Any) -> tuple[dict[str, float], torch.Tensor]:
    """``call(generator)`` on a generator in ``state``: its result, and the generator's state after."""
    generator = torch.Generator()
    generator.set_state(state)
    return call(generator), generator.get_state()


def open_policy(name: str, cfg: TrainConfig, model_path: str, init_path: str, run_dir: Path) -> Policy:
    """Load ``model_path`` (the start, or a checkpoint's copy) for training and serving; the reference
    and the critic start from ``init_path`` (the run's starting model)."""
    policy = load_trainable(name, cfg, model_path, init_path)
    policy.engine, policy.servers = open_policy_engine(name, cfg, model_path, run_dir)
    return policy


def open_policy_engine(name: str, cfg: TrainConfig, model_path: str, run_dir: Path) -> tuple[InferenceEngine, Any]:
    """The policy's inference engine, serving ``model_path``, and the servers behind it (or None)."""
    engine_dir = run_dir if name == SHARED else run_dir / "policies" / name
    engine = cfg.engine
    if engine.backend in ("hf", "serve-model") and cfg.rollout.max_staleness == 0:
        engine = replace(engine, cpu_threads=0)  # a synchronous run never decodes beside an update: all cores
    return open_engine(engine, model_path, cfg.model.dtype, run_dir=engine_dir, seed=cfg.seed)


def trainer_threads(cfg: TrainConfig) -> int:
    """Intra-op threads of the trainer (thread or process) when ``ppo.cpu_threads`` is 0: all cores, less
    those of the local CPU engines (in this process, its own, or launched serve-model servers) that keep
    decoding during updates (max_staleness > 0). Oversubscribed OpenMP teams wait on each other
    (measured: docs/benchmarks.md, "CPU threads")."""
    e = cfg.engine
    if cfg.rollout.max_staleness == 0 or e.urls or e.backend == "sglang" or not e.cpu_threads:
        return DEFAULT_CPU_THREADS
    engines = e.num_servers if e.backend == "serve-model" else 1  # launched here, beside the trainer
    return max(1, DEFAULT_CPU_THREADS - engines * e.cpu_threads)


def load_trainable(name: str, cfg: TrainConfig, model_path: str, init_path: str) -> Policy:
    """The training side of a policy (model, optimizer, schedule, reference, critic), without an engine."""
    p = cfg.ppo
    model = load_model(model_path, cfg.model.dtype)
    total = cfg.steps * p.ppo_epochs * p.num_minibatches
    optimizer, scheduler = make_optimizer(model, p.lr, p.weight_decay, p.warmup_steps, p.lr_schedule, total)
    policy = Policy(name, model, None, optimizer, scheduler)
    if p.activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if p.kl_coef > 0:
        policy.reference = load_model(init_path, cfg.model.dtype).eval().requires_grad_(False)
    if p.advantage == "gae":  # a value model initialised from the starting checkpoint
        critic_lm = load_model(init_path, cfg.model.dtype)
        if p.activation_checkpointing:
            critic_lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        policy.critic = ValueModel(critic_lm)
        policy.critic_optimizer = torch.optim.AdamW(
            policy.critic.parameters(), lr=p.critic_lr, weight_decay=p.weight_decay
        )
    return policy
