"""The two seams of the RL recipe: a `TrainablePolicy` (one trained model with what trains and serves it)
and a `Launcher` (where a run's parts execute), both chosen before the recipe runs and handed to it.

Implementations of `TrainablePolicy`:

=========================================================  ==================================================
`areal_agents.trainers.policy.Policy`                      updates in a thread of this process
`areal_agents.trainers.remote_policy.RemotePolicy`         updates elsewhere, through a `TrainerTransport`:
                                                           spawned processes (`PipeTransport`, ``ppo.trainer``,
                                                           ``ppo.nproc_per_node``) or Ray ranks (`RayTransport`)
=========================================================  ==================================================

A LoRA policy is a `Policy` whose `model` is the base with its adapter attached (`areal_agents.trainers.lora`)
and whose weight sync (`areal_agents.engines.lora_sync.LoraSync`) pushes the adapter only, under the policy's
name. Several, one per agent (``policies.AGENT.lora``), share one base model and one engine: each pushes its
own adapter, the engine serves them side by side.

Implementations of `Launcher`: `areal_agents.trainers.local_launcher.LocalLauncher` (this machine) and
`areal_agents.cluster.ray_launcher.RayLauncher` (``launcher: ray``); ``areal_agents.cluster.open_launcher``
picks one from the config.

Example::

    spec = TrainSpec.of(cfg, pad_token_id=tokenizer.pad_token_id)
    policy = launcher.open_policy("policy", cfg.model.path, cfg.model.path, spec)
    stats = await policy.update(trajectories, generator)
    await policy.push_weights()  # the engine now serves version + 1
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from areal_agents.config import LoraConfig, PolicyConfig, PPOConfig, TrainConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.weight_sync import WeightSource, WeightSync
from areal_agents.envs.runtime.backends import EnvBackend
from areal_agents.rollout.episodes import EpisodeFn
from areal_agents.types import Trajectory

SHARED = "policy"  # the name of the one policy of a run without separate policies


@dataclass(frozen=True)
class TrainSpec:
    """What a policy's trainer needs: the PPO settings and the few facts of the run they depend on."""

    ppo: PPOConfig
    temperature: float  # the rollouts' sampling temperature (the trainer scales logits by the same)
    pad_token_id: int
    dtype: str  # of the trained model (``model.dtype``)
    total_steps: int  # training steps of the run (the learning-rate schedule's length)
    seed: int = 0  # seeds a trainer in another process
    cpu_threads: int = 0  # the trainer's intra-op threads; 0: torch's default
    max_new_tokens: int | None = None  # the rollouts' budget per turn: Lmax of ppo.overlong_buffer's penalty
    lora: LoraConfig | None = None  # train this adapter over the frozen starting model (``model.lora``)

    @classmethod
    def of(cls, cfg: TrainConfig, pad_token_id: int) -> TrainSpec:
        """The spec of a run (``cpu_threads``: ``ppo.cpu_threads``; a launcher may fill in 0)."""
        return cls(
            cfg.ppo,
            cfg.rollout.temperature,
            pad_token_id,
            cfg.model.dtype,
            cfg.steps,
            cfg.seed,
            cfg.ppo.cpu_threads,
            cfg.rollout.max_new_tokens,
            cfg.model.lora,
        )


def policy_starts(cfg: TrainConfig) -> dict[str, PolicyConfig]:
    """Each policy of the run by name: its starting model and its adapter (None: full weights). One shared
    policy (`SHARED`) of ``model.path`` and ``model.lora`` unless ``policies`` names one per agent."""
    if not cfg.policies:
        return {SHARED: PolicyConfig(cfg.model.path, cfg.model.lora)}
    return {
        name: PolicyConfig(p, None) if isinstance(p, str) else PolicyConfig(p.path or cfg.model.path, p.lora)
        for name, p in cfg.policies.items()
    }


@runtime_checkable
class TrainablePolicy(WeightSource, Protocol):
    """One trained model: its updates, its engine (``engine``, generation), how new weights reach it (it is the
    `WeightSource` its ``weight_sync`` pushes) and its checkpoints, written where its weights live.

    ``streams``: True when `update_part` starts computing on each part as it comes (an update fed a batch's
    groups as they finish, ``ppo.stream_updates``); False: the parts wait for `finish_update`, one `update`
    of the whole batch, so the recipe calls only `update`.
    """

    name: str
    engine: InferenceEngine
    weight_sync: WeightSync
    streams: bool

    async def update(self, trajectories: list[Trajectory], generator: torch.Generator) -> dict[str, float]:
        """One PPO update on ``trajectories``; its stats."""
        ...

    async def update_part(self, trajectories: list[Trajectory]) -> None:
        """Part of a batch (whole groups) for the update `finish_update` ends."""
        ...

    async def finish_update(self, generator: torch.Generator) -> dict[str, float]:
        """The update of the parts fed since the last one (none: a skipped step); its stats."""
        ...

    async def push_weights(self) -> None:
        """The trained weights to the engine (through ``weight_sync``): it serves version + 1."""
        ...

    def adapter_config(self) -> dict[str, Any] | None:
        """A LoRA policy's ``adapter_config.json`` content (its weights are the adapter); None: full weights."""
        ...

    def save_checkpoint(self, path: Path) -> None:
        """The current weights under ``path`` as a checkpoint's model directory (``save_pretrained``'s files;
        a LoRA policy's adapter as PEFT's directory), written by the process that holds them."""
        ...

    def save_train_state(self, path: Path, key: str | None = None) -> None:
        """Add `state_dict` to a checkpoint's ``trainer_state.pt`` at ``path`` (at its top, or under
        ``["policies"][key]``), by the process that holds it."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The train state a checkpoint keeps besides the model: optimizer, schedule, critic."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def load_train_state(self, path: Path, key: str | None = None) -> None:
        """`load_state_dict` of what `save_train_state` put at ``path``, with the run's ``ppo`` rates (an allowed
        change of ``lr``, ``critic_lr`` or ``weight_decay`` takes effect), read by the process that trains."""
        ...

    async def wait_idle(self) -> None:
        """Return when no update runs (one abandoned by a signal may still be computing)."""
        ...

    def close(self) -> None:
        """Stop its trainer and the servers launched for its engine (the engine client is closed apart)."""
        ...


@runtime_checkable
class Launcher(Protocol):
    """Where a run's parts execute: its policies' trainers and engines, its envs, its episodes."""

    def start(self) -> None:
        """Acquire what the run needs before its policies (a cluster, env servers)."""
        ...

    def open_policy(self, name: str, model_path: str, init_path: str, spec: TrainSpec) -> TrainablePolicy:
        """A policy trained from ``model_path`` (the start, or a checkpoint's copy), served by a new engine;
        its reference and critic start from ``init_path`` (the run's starting model)."""
        ...

    def env_backend(self) -> EnvBackend | None:
        """The env backend of the run's episodes; None: the config's (`open_env_backend`)."""
        ...

    def episode_runner(self, policy: TrainablePolicy) -> EpisodeFn | None:
        """Where episodes run; None: in this process, by the recipe's agent."""
        ...

    def stats(self) -> dict[str, Any]:
        """Where the work went, for the run's summary; empty for nothing to say."""
        ...

    def shutdown(self) -> None:
        """Stop everything `start` and `open_policy` started."""
        ...
