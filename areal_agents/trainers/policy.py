"""`Policy`: one trained model with what trains it (optimizer, schedule, critic, reference), its updates in a
thread of this process; it serves through its engine. A run has one shared policy, or one per agent id
(``policies`` in the config). It implements `TrainablePolicy` (`areal_agents.trainers.policy_api`).

Example::

    policy = load_trainable("policy", spec, model_path, model_path)
    policy.engine, policy.weight_sync = engine, InProcessSync([engine])
    stats = await policy.update(trajectories, torch.Generator().manual_seed(0))
    await policy.push_weights()
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.weight_sync import WeightSync, write_weights
from areal_agents.errors import ConfigError
from areal_agents.models.loading import load_model
from areal_agents.trainers.critic import ValueModel
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.optim import make_optimizer
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.trainers.ppo import StreamedUpdate, ppo_update
from areal_agents.types import Trajectory

SHARED = "policy"  # the name of the one policy of a run without separate policies

DEFAULT_CPU_THREADS = torch.get_num_threads()  # torch's intra-op default in this process (all cores)


@dataclass
class Policy:
    name: str
    model: PreTrainedModel  # the trainer's copy
    spec: TrainSpec
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: PreTrainedModel | None = None  # frozen initial policy, for ppo.kl_coef
    critic: ValueModel | None = None  # ppo.advantage=gae
    critic_optimizer: torch.optim.Optimizer | None = None
    engine: InferenceEngine | None = None  # the rollout copy (in-process, or servers behind a client); None on a rank
    weight_sync: WeightSync | None = None  # how `push_weights` reaches the engine
    servers: Any = None  # model servers launched for the engine, stopped by `close`
    trainer: ThreadPoolExecutor | None = None  # the one thread its updates run on (see `update`)
    streamed: StreamedUpdate | None = None  # the update being fed in parts (`update_part`), if any
    streams: ClassVar[bool] = True

    def close(self) -> None:
        """Stop its trainer thread and its engine's launched servers."""
        if self.trainer is not None:
            self.trainer.shutdown()
        if self.servers is not None:
            self.servers.stop()

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, schedule and critic (the model is saved apart)."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.critic is not None:
            state |= {"critic": self.critic.state_dict(), "critic_optimizer": self.critic_optimizer.state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None:
            if "critic" not in state:
                raise ConfigError("--resume: ppo.advantage=gae but the checkpoint holds no critic")
            self.critic.load_state_dict(state["critic"])
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])

    async def update(self, trajectories: list[Trajectory], generator: torch.Generator) -> dict[str, float]:
        """One PPO update in the policy's trainer thread (rollouts keep running on the event loop).

        Always the same thread, with ``spec.cpu_threads`` intra-op threads: torch's OpenMP workers belong
        to the thread that starts them, and every extra set competes for the same cores (updates hopping
        between pool threads, beside the engine's and the event loop's, ran slower)."""
        return await self._in_trainer(functools.partial(self.train_step, trajectories, generator))

    async def update_part(self, trajectories: list[Trajectory]) -> None:
        """Forward and backward on part of a batch (whole groups) in the trainer thread; `finish_update`
        steps. The rollout loop feeds a batch's groups as they finish (``ppo.stream_updates``)."""
        await self._in_trainer(functools.partial(self.train_part, trajectories))

    async def finish_update(self, generator: torch.Generator) -> dict[str, float]:
        """The optimizer step of the parts fed so far (none: a skipped step, as `update` of no data); its stats."""
        return await self._in_trainer(functools.partial(self.finish_step, generator))

    async def wait_idle(self) -> None:
        """Return when the trainer thread has finished what it was given (an abandoned backward)."""
        if self.trainer is not None:
            await asyncio.get_running_loop().run_in_executor(self.trainer, int)

    async def _in_trainer(self, call: functools.partial) -> Any:
        if self.trainer is None:
            threads = self.spec.cpu_threads or DEFAULT_CPU_THREADS
            self.trainer = ThreadPoolExecutor(
                1, f"trainer-{self.name}", initializer=torch.set_num_threads, initargs=(threads,)
            )
        return await asyncio.get_running_loop().run_in_executor(self.trainer, call)

    def train_part(self, trajectories: list[Trajectory]) -> None:
        """`StreamedUpdate.add` (the first part of a batch starts the update)."""
        if self.streamed is None:
            s = self.spec
            self.streamed = StreamedUpdate(
                self.model,
                self.optimizer,
                self.scheduler,
                s.ppo,
                temperature=s.temperature,
                pad_token_id=s.pad_token_id,
                ref_model=self.reference,
                max_new_tokens=s.max_new_tokens,
            )
        self.streamed.add(trajectories)

    def finish_step(self, generator: torch.Generator) -> dict[str, float]:
        """`StreamedUpdate.finish` of the parts fed since the last step."""
        if self.streamed is None:
            self.train_part([])
        update, self.streamed = self.streamed, None
        return update.finish(generator)

    def train_step(
        self, trajectories: list[Trajectory], generator: torch.Generator, dp: DataParallel | None = None
    ) -> dict[str, float]:
        """One PPO update (``dp``: as one rank of a data-parallel group)."""
        s = self.spec
        return ppo_update(
            self.model,
            self.optimizer,
            self.scheduler,
            trajectories,
            s.ppo,
            temperature=s.temperature,
            pad_token_id=s.pad_token_id,
            generator=generator,
            ref_model=self.reference,
            critic=self.critic,
            critic_optimizer=self.critic_optimizer,
            dp=dp,
            max_new_tokens=s.max_new_tokens,
        )

    def remote_train_step(
        self, trajectories: list[Trajectory], generator_state: torch.Tensor, dp: DataParallel | None = None
    ) -> tuple[dict[str, float], torch.Tensor]:
        """`train_step` where the caller's generator lives in another process: its state in, its state out."""
        return _with_generator(generator_state, lambda g: self.train_step(trajectories, g, dp))

    def remote_finish_step(self, generator_state: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
        """`finish_step` where the caller's generator lives in another process: its state in, its state out."""
        return _with_generator(generator_state, self.finish_step)

    async def push_weights(self) -> None:
        await self.weight_sync.push(self)  # pause, swap, version + 1, resume

    async def tensors(self) -> dict[str, torch.Tensor]:
        """The trainer's weights (a `WeightSource`)."""
        return self.model.state_dict()

    async def save_weights(self, path: Path) -> None:
        """The trainer's weights as ``path/model.safetensors`` (a `WeightSource`)."""
        await asyncio.to_thread(write_weights, self.model.state_dict(), path)


def _with_generator(state: torch.Tensor, call: Any) -> tuple[dict[str, float], torch.Tensor]:
    """``call(generator)`` on a generator in ``state``: its result, and the generator's state after."""
    generator = torch.Generator()
    generator.set_state(state)
    return call(generator), generator.get_state()


def load_trainable(name: str, spec: TrainSpec, model_path: str, init_path: str) -> Policy:
    """The training side of a policy (model, optimizer, schedule, reference, critic), without an engine;
    the reference and the critic start from ``init_path`` (the run's starting model)."""
    p = spec.ppo
    model = load_model(model_path, spec.dtype)
    total = spec.total_steps * p.ppo_epochs * p.num_minibatches
    optimizer, scheduler = make_optimizer(model, p.lr, p.weight_decay, p.warmup_steps, p.lr_schedule, total)
    policy = Policy(name, model, spec, optimizer, scheduler)
    if p.activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if p.kl_coef > 0:
        policy.reference = load_model(init_path, spec.dtype).eval().requires_grad_(False)
    if p.advantage == "gae":  # a value model initialised from the starting checkpoint
        critic_lm = load_model(init_path, spec.dtype)
        if p.activation_checkpointing:
            critic_lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        policy.critic = ValueModel(critic_lm)
        policy.critic_optimizer = torch.optim.AdamW(
            policy.critic.parameters(), lr=p.critic_lr, weight_decay=p.weight_decay
        )
    return policy


def __getattr__(name: str) -> Any:
    """`open_policy`, `open_policy_engine` and `trainer_threads` live in `areal_agents.trainers.local_launcher`."""
    if name in ("open_policy", "open_policy_engine", "trainer_threads"):
        from areal_agents.trainers import local_launcher  # noqa: PLC0415  (it imports this module)

        return getattr(local_launcher, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
