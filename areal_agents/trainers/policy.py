"""`Policy`: one trained model with what trains it (optimizer, schedule, critic, reference), its updates in a
thread of this process; it serves through its engine. A run has one shared policy, or one per agent id
(``policies`` in the config). It implements `TrainablePolicy` (`areal_agents.trainers.policy_api`).

Example::

    serving = Serving(engine, InProcessSync([engine]), None)  # what `PolicyServing` opens for a launcher
    policy = load_trainable("policy", spec, model_path, model_path, serving=serving)
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

from areal_agents.config.placement import team_threads
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.serving import Serving
from areal_agents.engines.weight_sender import HeldWeights
from areal_agents.engines.weight_sync import WeightSync
from areal_agents.errors import ConfigError
from areal_agents.models.device import compute_dtype, resolve_device
from areal_agents.models.loading import empty_model, load_model
from areal_agents.models.weight_files import write_weights
from areal_agents.timeline import timeline
from areal_agents.trainers import fsdp
from areal_agents.trainers.checkpoint import add_train_state, read_train_state
from areal_agents.trainers.critic import ValueModel
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.lora import Adapter, AdapterOffLM, LoraBase, attach_lora, is_adapter_dir, write_adapter
from areal_agents.trainers.meta_load import materialize, prefixed
from areal_agents.trainers.optim import make_optimizer
from areal_agents.trainers.policy_api import SHARED as SHARED  # the one shared policy's name, re-exported
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.trainers.ppo import StreamedUpdate, ppo_update
from areal_agents.trainers.resume import with_config_rates
from areal_agents.types import Trajectory


@dataclass
class Policy(HeldWeights):
    name: str
    model: PreTrainedModel  # the trainer's copy
    spec: TrainSpec
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: torch.nn.Module | None = None  # frozen initial policy, for ppo.kl_coef (a `ScoredLM` when sharded)
    critic: ValueModel | None = None  # ppo.advantage=gae
    critic_optimizer: torch.optim.Optimizer | None = None
    engine: InferenceEngine | None = None  # the rollout copy (in-process, or servers behind a client); None on a rank
    weight_sync: WeightSync | None = None  # how `push_weights` reaches the engine
    servers: Any = None  # model servers launched for the engine, stopped by `close`
    trainer: ThreadPoolExecutor | None = None  # the one thread its updates run on (see `update`)
    streamed: StreamedUpdate | None = None  # the update being fed in parts (`update_part`), if any
    dp: DataParallel | None = None  # this rank's group when FSDP2-sharded (`load_trainable`)
    trained: torch.nn.Module | None = None  # what `ppo_update` trains: ``model``, or its sharded `ScoredLM` root
    adapter: Adapter | None = None  # a LoRA policy's adapter (``model`` is its base, shared by every LoRA policy)
    streams: ClassVar[bool] = True

    def __post_init__(self) -> None:
        timeline().idle(self.worker)  # a row from the start: waiting for the first batch is idle time

    def close(self) -> None:
        """Stop its trainer thread and its engine's launched servers."""
        if self.trainer is not None:
            self.trainer.shutdown()
        if self.servers is not None:
            self.servers.stop()

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, schedule and critic (the model is saved apart); sharded, the full state in the
        single-process layout, gathered by every rank (call it on all) and kept by rank 0."""
        if self.dp is not None:
            state = {"optimizer": fsdp.full_optimizer_state(self.trained, self.optimizer)}
            if self.critic is not None:
                state["critic"] = fsdp.full_state_dict(self.critic)
                state["critic_optimizer"] = fsdp.full_optimizer_state(self.critic, self.critic_optimizer)
            return state | {"scheduler": self.scheduler.state_dict()}
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.critic is not None:
            state |= {"critic": self.critic.state_dict(), "critic_optimizer": self.critic_optimizer.state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A `state_dict` of any number of ranks (every rank is given all of it when sharded)."""
        if self.critic is not None and "critic" not in state:
            raise ConfigError("--resume: ppo.advantage=gae but the checkpoint holds no critic")
        self.scheduler.load_state_dict(state["scheduler"])
        if self.dp is not None:
            fsdp.load_optimizer_state(self.trained, self.optimizer, state["optimizer"])
            if self.critic is not None:
                fsdp.load_full_state_dict(self.critic, state["critic"])
                fsdp.load_optimizer_state(self.critic, self.critic_optimizer, state["critic_optimizer"])
            return
        self.optimizer.load_state_dict(state["optimizer"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])

    def load_train_state(self, path: Path, key: str | None = None) -> None:
        """`load_state_dict` of a checkpoint's train state at ``path`` (`read_train_state`) with ``spec.ppo``'s
        rates; sharded, every rank reads it (call it on all)."""
        p = self.spec.ppo
        self.load_state_dict(with_config_rates(read_train_state(Path(path), key), p.lr, p.weight_decay, p.critic_lr))

    def weights(self) -> dict[str, torch.Tensor]:
        """The trained model's state dict; sharded, the full one on the CPU, gathered by every rank (call
        it on all) and kept by rank 0 (``{}`` elsewhere)."""
        if self.adapter is not None:  # a LoRA policy's adapter alone (gathered by every rank when sharded)
            return self.adapter.tensors()
        if self.dp is None:
            return self.model.state_dict()
        return fsdp.full_state_dict(self.trained)

    async def update(self, trajectories: list[Trajectory], generator: torch.Generator) -> dict[str, float]:
        """One PPO update in the policy's trainer thread (rollouts keep running on the event loop).

        Always the same thread, with ``spec.cpu_threads`` intra-op threads: torch's OpenMP workers belong
        to the thread that starts them, and every extra set competes for the same cores (updates hopping
        between pool threads, beside the engine's and the event loop's, ran slower)."""
        version = self.version()
        return await self._in_trainer(functools.partial(self.train_step, trajectories, generator, version=version))

    async def update_part(self, trajectories: list[Trajectory]) -> None:
        """Forward and backward on part of a batch (whole groups) in the trainer thread; `finish_update`
        steps. The rollout loop feeds a batch's groups as they finish (``ppo.stream_updates``)."""
        await self._in_trainer(functools.partial(self.train_part, trajectories, self.version()))

    async def finish_update(self, generator: torch.Generator) -> dict[str, float]:
        """The optimizer step of the parts fed so far (none: a skipped step, as `update` of no data); its stats."""
        return await self._in_trainer(functools.partial(self.finish_step, generator))

    async def wait_idle(self) -> None:
        """Return when the trainer thread has finished what it was given (an abandoned backward)."""
        if self.trainer is not None:
            await asyncio.get_running_loop().run_in_executor(self.trainer, int)

    async def _in_trainer(self, call: functools.partial) -> Any:
        if self.trainer is None:
            threads = self.spec.cpu_threads or team_threads()  # 0: auto (a launcher fills in the run's)
            self.trainer = ThreadPoolExecutor(
                1, f"trainer-{self.name}", initializer=torch.set_num_threads, initargs=(threads,)
            )
        return await asyncio.get_running_loop().run_in_executor(self.trainer, self._with_adapter, call)

    def _with_adapter(self, call: functools.partial) -> Any:
        """``call()``; a LoRA policy's with its adapter the active one on the shared base (`Adapter.active`)."""
        if self.adapter is None:
            return call()
        with self.adapter.active():
            return call()

    @property
    def worker(self) -> str:
        """This trainer's row in the run's timeline (busy while it updates)."""
        return f"trainer/{self.name}" + (f"/rank{self.dp.rank}" if self.dp is not None else "")

    def version(self) -> int | None:
        """The engine's version: that of the weights this trainer holds between pushes (None: no engine here)."""
        return self.engine.get_version() if self.engine is not None else None

    def train_part(self, trajectories: list[Trajectory], version: int | None = None) -> None:
        """`StreamedUpdate.add` (the first part of a batch starts the update; ``version``: `version`)."""
        with timeline().busy(self.worker):
            self._add_part(trajectories, version)

    def _add_part(self, trajectories: list[Trajectory], version: int | None) -> None:
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
                policy_version=version,
            )
        self.streamed.add(trajectories)

    def finish_step(self, generator: torch.Generator) -> dict[str, float]:
        """`StreamedUpdate.finish` of the parts fed since the last step."""
        with timeline().busy(self.worker):
            if self.streamed is None:
                self._add_part([], None)
            update, self.streamed = self.streamed, None
            return update.finish(generator)

    def train_step(
        self,
        trajectories: list[Trajectory],
        generator: torch.Generator,
        dp: DataParallel | None = None,
        version: int | None = None,
    ) -> dict[str, float]:
        """One PPO update (``dp``: as one rank of a data-parallel group; ``version``: the engine's, `version`)."""
        with timeline().busy(self.worker):
            return self._ppo_update(trajectories, generator, dp, version)

    def _ppo_update(
        self, trajectories: list[Trajectory], generator: torch.Generator, dp: DataParallel | None, version: int | None
    ) -> dict[str, float]:
        s = self.spec
        return ppo_update(
            self.trained if self.trained is not None else self.model,
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
            dp=dp if dp is not None else self.dp,
            max_new_tokens=s.max_new_tokens,
            policy_version=version,
        )

    def remote_train_step(
        self,
        trajectories: list[Trajectory],
        generator_state: torch.Tensor,
        dp: DataParallel | None = None,
        version: int | None = None,
    ) -> tuple[dict[str, float], torch.Tensor]:
        """`train_step` where the caller's generator lives in another process: its state in, its state out."""
        return _with_generator(generator_state, lambda g: self.train_step(trajectories, g, dp, version))

    def remote_finish_step(self, generator_state: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
        """`finish_step` where the caller's generator lives in another process: its state in, its state out."""
        return _with_generator(generator_state, self.finish_step)

    async def push_weights(self) -> None:
        await self.weight_sync.push(self)  # pause, swap, version + 1, resume

    async def tensors(self) -> dict[str, torch.Tensor]:
        """The trainer's weights (a `WeightSource`): a LoRA policy's adapter alone, keyed as PEFT saves it."""
        return self.adapter.tensors() if self.adapter is not None else self.model.state_dict()

    async def save_weights(self, path: Path, dtype: str | None = None) -> None:
        """The trainer's weights under ``path`` by `write_weights` (in ``dtype``; None: as held; a `WeightSource`);
        a LoRA policy's adapter as PEFT's directory (``save_pretrained``), as it is held."""
        if self.adapter is not None:
            await asyncio.to_thread(self.adapter.save_pretrained, path)
            return
        await asyncio.to_thread(write_weights, self.model.state_dict(), path, dtype)

    def adapter_config(self) -> dict[str, Any] | None:
        """A LoRA policy's ``adapter_config.json`` content (None: a full-weight policy)."""
        return self.adapter.config() if self.adapter is not None else None

    def save_train_state(self, path: Path, key: str | None = None) -> None:
        """`state_dict` into the checkpoint's ``trainer_state.pt`` at ``path`` (`add_train_state`: ``key`` None
        at its top); sharded, every rank gathers it (call it on all) and rank 0 writes it."""
        state = self.state_dict()
        if self.dp is None or self.dp.rank == 0:
            add_train_state(path, state, key)

    def save_checkpoint(self, path: Path) -> None:
        """The weights as a checkpoint's model directory: ``save_pretrained``'s files, or a LoRA policy's adapter
        (PEFT's directory). Sharded, every rank gathers the full weights (call it on all); rank 0 writes them."""
        writes = self.dp is None or self.dp.rank == 0
        if self.adapter is not None:
            tensors, config = self.adapter.tensors(), self.adapter.config()
            if writes:
                write_adapter(path, tensors, config)
        elif self.dp is None:
            self.model.save_pretrained(path)
        else:
            weights = fsdp.full_state_dict(self.trained)
            if writes:
                self.model.save_pretrained(path, state_dict=fsdp.tied_as_one(self.model, weights))


def _with_generator(state: torch.Tensor, call: Any) -> tuple[dict[str, float], torch.Tensor]:
    """``call(generator)`` on a generator in ``state``: its result, and the generator's state after."""
    generator = torch.Generator()
    generator.set_state(state)
    return call(generator), generator.get_state()


def load_trainable(
    name: str,
    spec: TrainSpec,
    model_path: str,
    init_path: str,
    dp: DataParallel | None = None,
    lora_base: LoraBase | None = None,
    serving: Serving | None = None,
) -> Policy:
    """A policy: its training side (model, optimizer, schedule, reference, critic) and ``serving``, its engine,
    sync and servers (None: no engine, a rank of a trainer in another process); with ``spec.lora``, an
    adapter named ``name`` on ``lora_base`` (the base model other LoRA policies share); the reference and the
    critic start from ``init_path`` (the run's starting model). On ``ppo.device``; with ``dp`` (a rank of
    several) every model is FSDP2-sharded over the ranks (`fsdp.shard_policy`), from rank 0's weights: built
    on the meta device, sharded, then loaded from the checkpoint rank 0 alone reads (`meta_load`; the other
    ranks read only its config). A LoRA policy's models load whole on every rank and rank 0's are broadcast."""
    p = spec.ppo
    device = dp.device if dp is not None else resolve_device(p.device)
    adapter = _adapter(name, spec, model_path, init_path, lora_base) if spec.lora is not None else None
    on_meta = dp is not None and dp.world_size > 1 and adapter is None
    build = empty_model if on_meta else load_model
    model = adapter.peft.get_base_model() if adapter is not None else build(model_path, spec.dtype)
    if p.activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    reference = critic = None
    if p.kl_coef > 0 and adapter is None:  # LoRA's: the same model with its adapter off (below)
        reference = build(init_path, spec.dtype).eval().requires_grad_(False)
    if p.advantage == "gae":  # a value model initialised from the starting checkpoint (LoRA: its own adapter)
        critic_lm = build(init_path, spec.dtype)
        if spec.lora is not None:
            critic_lm = attach_lora(critic_lm, spec.lora).get_base_model()
        if p.activation_checkpointing:
            critic_lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        critic = ValueModel(critic_lm)
    trained = model
    if device.type != "cpu" and not on_meta:
        for module in (model, reference, critic):
            if module is not None:
                module.to(device)  # before a broadcast: NCCL sends only CUDA tensors
    if dp is not None:
        if dp.world_size > 1 and not on_meta:
            for module in (model, reference, critic):
                if module is not None:
                    dp.broadcast_parameters(module)  # every rank starts from rank 0's weights, as DDP does
        dtype = compute_dtype(device, p.compute_dtype)
        trained, reference, critic = fsdp.shard_policy(model, reference, critic, device, dtype)
        if on_meta:
            _load_shards(dp, spec.dtype, model_path, init_path, trained, reference, critic)
    if p.kl_coef > 0 and adapter is not None:
        reference = AdapterOffLM(adapter, trained if dp is not None else None)
    total = spec.total_steps * p.ppo_epochs * p.num_minibatches
    params = adapter.parameters() if adapter is not None else None
    optimizer, scheduler = make_optimizer(trained, p.lr, p.weight_decay, p.warmup_steps, p.lr_schedule, total, params)
    served = {"engine": serving.engine, "weight_sync": serving.sync, "servers": serving.servers} if serving else {}
    policy = Policy(
        name, model, spec, optimizer, scheduler, reference, dp=dp, trained=trained, adapter=adapter, **served
    )
    if critic is not None:
        policy.critic = critic
        policy.critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=p.critic_lr, weight_decay=p.weight_decay)
    return policy


def _load_shards(
    dp: DataParallel,
    dtype: str,
    model_path: str,
    init_path: str,
    trained: torch.nn.Module,
    reference: torch.nn.Module | None,
    critic: ValueModel | None,
) -> None:
    """The meta-built sharded models given rank 0's weights (`meta_load.materialize`): rank 0 reads each
    checkpoint in turn, whole, and drops it once its shards are out; the critic's head starts at 0. Rank 0's
    reads draw nothing from torch's random state (the ranks' states stay equal)."""
    reads = (
        (trained, lambda: prefixed(load_model(model_path, dtype).state_dict(), "lm.")),
        (reference, lambda: prefixed(load_model(init_path, dtype).state_dict(), "lm.")),
        (critic, lambda: ValueModel(load_model(init_path, dtype)).state_dict()),
    )
    for root, read in reads:
        if root is not None:
            with torch.random.fork_rng(devices=[]):
                state = read() if dp.rank == 0 else {}
            materialize(root, dp.device, state)
            del state


def _adapter(name: str, spec: TrainSpec, model_path: str, init_path: str, base: LoraBase | None) -> Adapter:
    """A LoRA policy's adapter ``name`` on ``base`` (None: a base of its own) over the starting model
    ``init_path`` (frozen): fresh, or the one saved at ``model_path`` (a checkpoint's, on ``--resume``)."""
    base = base if base is not None else LoraBase(init_path, spec.dtype)
    if base.path != init_path:
        raise ConfigError(f"policy {name!r}: LoRA policies share one base model ({base.path}), not {init_path}")
    return base.add(name, spec.lora, model_path if is_adapter_dir(model_path) else None)
