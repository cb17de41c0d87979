"""`RayLauncher`: the Ray side of ``areal-agents train ... launcher=ray``.

Joins a cluster (``ray.address``) or starts a local one, checks that the roles' resource requests fit,
and starts the actors: env servers (replicas), model servers per policy, rollout workers and the
trainer ranks. It is a `Launcher` (`areal_agents.trainers.policy_api`): the RL recipe asks it for the
policy, the env backend and the episode runner, and runs the same training loop as a local run.

Example::

    launcher = RayLauncher(cfg)  # or areal_agents.cluster.open_launcher(cfg)
    run_train(cfg, launcher=launcher)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import secrets
from pathlib import Path

import ray

from areal_agents.cluster.engine_servers import EngineServers
from areal_agents.cluster.env_servers import EnvServers
from areal_agents.cluster.rollout_workers import RolloutWorkers
from areal_agents.cluster.trainer_group import RayTransport
from areal_agents.config import EngineConfig, TrainConfig
from areal_agents.data.sources import datasets_in
from areal_agents.engines.server_control import ADMIN_KEY_ENV
from areal_agents.engines.serving import PolicyServing
from areal_agents.engines.supervisor import ServerGroup, Servers
from areal_agents.envs.runtime.backends import EnvBackend
from areal_agents.errors import ConfigError
from areal_agents.rollout.episodes import EpisodeFn
from areal_agents.timeline.recorder import DIR_ENV, OPTIONS_ENV
from areal_agents.trainers.local_launcher import lora_serving
from areal_agents.trainers.policy_api import TrainablePolicy, TrainSpec, policy_starts
from areal_agents.trainers.remote_policy import RemotePolicy

log = logging.getLogger(__name__)


class RayLauncher:
    """A `Launcher` on a Ray cluster; reads ``ray``, ``engine``, ``env``, ``model`` and ``rollout`` (for the
    rollout workers' agents) of the config."""

    def __init__(self, cfg: TrainConfig) -> None:
        full = [name for name, start in policy_starts(cfg).items() if start.lora is None]
        if cfg.policies and full:
            raise ConfigError(
                f"launcher=ray: separate full-weight `policies` ({', '.join(full)}) are not supported on Ray yet; "
                "use one shared policy, or give each agent an adapter (policies.AGENT.lora)"
            )
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.started = False
        self.env_servers: EnvServers | None = None
        self.workers: RolloutWorkers | None = None
        self.serving = PolicyServing(self.run_dir, cfg.seed)  # LoRA policies share the base model's servers
        self.addresses: dict[str, list[str]] = {}  # each policy's model servers, by policy name
        # the run's admin key: its serve-model actors (on node addresses) want it on their control routes; the
        # driver's clients and the rollout workers send it (AREAL_ADMIN_KEY, or one made for this run)
        self.admin_key = os.environ.get(ADMIN_KEY_ENV) or secrets.token_urlsafe(24)
        self.servers_key: str | None = None  # what the servers' clients send: the run's key, or (engine.urls) none

    def start(self) -> None:
        """Join or start the cluster, check the resource requests, start the env servers."""
        cfg = self.cfg
        self.started = connect(cfg)
        try:
            check_resources(cfg)
            r = cfg.ray
            self.env_servers = EnvServers.launch(
                cfg.env,
                r.env_servers,
                r.env_server_cpus,
                r.max_restarts,
                r.recovery_timeout_s,
                datasets=datasets_in(cfg.eval.env_kwargs),
            )
        except BaseException:
            self.shutdown()
            raise

    def open_policy(self, name: str, model_path: str, init_path: str, spec: TrainSpec) -> TrainablePolicy:
        """Model servers (actors, or ``engine.urls``) and the trainer ranks of one policy. LoRA policies share
        the base model's servers (started with the first), each pushing its adapter under its name."""
        r, lora = self.cfg.ray, spec.lora is not None
        e = self._engine_config()
        served = init_path if lora else model_path
        launch = functools.partial(self._servers, e, served, spec.dtype)  # called only when this policy needs them
        s = self.serving.open(name, e, served, spec.dtype, lora=lora, servers=launch)
        if s.servers is not None:
            self.addresses[name], self.servers_key = s.servers.addresses, s.servers.admin_key
        else:  # a LoRA policy on the base model's servers, opened with the first
            self.addresses[name] = next(iter(self.addresses.values()))
        try:
            ranks = RayTransport.launch(
                spec, name, model_path, init_path, r.trainer_ranks, r.trainer_cpus, r.trainer_gpus
            )
            return RemotePolicy(name, spec, s, ranks)  # the recipe closes it
        except BaseException:
            if s.servers is not None:
                s.servers.stop()
            raise

    def _engine_config(self) -> EngineConfig:
        """The engine config the servers run with: LoRA-enabled when the run trains adapters; the hf engine as
        serve-model (the same engine behind the SGLang protocol, so rollout workers reach it)."""
        e = lora_serving(self.cfg).engine
        return dataclasses.replace(e, backend="serve-model") if e.backend == "hf" and not e.urls else e

    def _servers(self, e: EngineConfig, model_path: str, dtype: str) -> Servers:
        """The servers of one policy's engine: model-server actors, or ``engine.urls``."""
        if e.urls:
            return ServerGroup(list(e.urls))  # their admin key, if any: AREAL_ADMIN_KEY
        r = self.cfg.ray
        return EngineServers(
            e, model_path, dtype, self.run_dir / "servers", r.engine_server_cpus, r.engine_server_gpus,
            admin_key=self.admin_key if e.backend == "serve-model" else None,
        )  # fmt: skip

    def env_backend(self) -> EnvBackend:
        return EnvBackend(self.cfg.env, self.env_servers.pool())

    def episode_runner(self, policy: TrainablePolicy) -> EpisodeFn:
        """Episodes on the rollout workers, against ``policy``'s model servers."""
        if self.workers is None:
            addresses = self.addresses[policy.name]
            self.workers = RolloutWorkers.launch(self.cfg, addresses, self.env_servers, self.servers_key)
        return self.workers.run_episode

    def stats(self) -> dict:
        """Where the work went: episodes per rollout worker, env steps per env server, lost workers."""
        r = self.cfg.ray
        return {
            "env_servers": r.env_servers,
            "rollout_workers": r.rollout_workers,
            "trainer_ranks": r.trainer_ranks,
            "episodes_per_worker": list(self.workers.episodes) if self.workers else [],
            "episodes_lost_with_a_worker": self.workers.lost if self.workers else 0,
            "env_steps_per_server": self.env_servers.steps(),
        }

    def shutdown(self) -> None:
        """Stop every actor of the run (and the local cluster, if this run started it), each whatever the
        others raise; its model-server and trainer actors go with its policies (`TrainablePolicy.close`)."""
        with contextlib.ExitStack() as stack:  # the last pushed runs first
            if self.started:
                stack.callback(lambda: ray.is_initialized() and ray.shutdown())
            if self.env_servers is not None:
                stack.callback(self.env_servers.kill)
            if self.workers is not None:
                stack.callback(self.workers.kill)


def connect(cfg: TrainConfig) -> bool:
    """Join ``ray.address`` or start a local cluster; True if this call started one."""
    if ray.is_initialized():
        return False
    # the driver's import path, so `module:Class` in the config resolves in the actors too (shared files)
    path = os.pathsep.join([os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    runtime_env = {"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}}
    # the run's timeline: actors record into the run dir (other nodes: when it is on a shared filesystem)
    runtime_env["env_vars"] |= {k: os.environ[k] for k in (DIR_ENV, OPTIONS_ENV) if k in os.environ}
    common = {"runtime_env": runtime_env, "logging_level": logging.WARNING, "log_to_driver": True}
    if cfg.ray.address:
        try:
            ray.init(address=cfg.ray.address, **common)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(f"ray.address={cfg.ray.address!r}: cannot join the cluster: {e}") from None
        return False
    ray.init(num_cpus=cfg.ray.num_cpus or os.cpu_count(), include_dashboard=False, **common)
    return True


def check_resources(cfg: TrainConfig) -> None:
    """Fail now, naming the keys, when the roles ask for more than the cluster has (Ray would wait forever)."""
    r = cfg.ray
    engines = 0 if cfg.engine.urls else cfg.engine.num_servers
    asks = {
        "CPU": {
            "env servers": r.env_servers * r.env_server_cpus,
            "rollout workers": r.rollout_workers * r.rollout_worker_cpus,
            "trainer ranks": r.trainer_ranks * r.trainer_cpus,
            "model servers": engines * r.engine_server_cpus,
        },
        "GPU": {"model servers": engines * r.engine_server_gpus},
    }
    have = ray.cluster_resources()
    for resource, parts in asks.items():
        total = sum(parts.values())
        if total > have.get(resource, 0.0) + 1e-9:
            detail = ", ".join(f"{k} {v:g}" for k, v in parts.items() if v)
            raise ConfigError(
                f"ray: the run asks for {total:g} {resource}s ({detail}) but the cluster has "
                f"{have.get(resource, 0.0):g}; lower ray.*_{resource.lower()}s (fractions are fine), "
                f"the replica counts, or add nodes"
            )
