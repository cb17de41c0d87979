"""Model servers (serve-model on CPU, SGLang on GPU, vLLM on either) as Ray actors, placed by the resources
they ask for; each actor runs the same server command the local launcher would, restarts it (on the same address,
with the run's current weights: `Supervisor`) when it dies or reports its engine failed, and stops it
when it goes."""

from __future__ import annotations

import ctypes
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import ray

from areal_agents.config import EngineConfig
from areal_agents.engines.local_servers import launch_servers
from areal_agents.errors import ArealAgentsError, ConfigError
from areal_agents.net import free_port


def _die_with_parent() -> None:
    """In the server's process: SIGTERM it when the actor's process dies (no orphaned servers)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent, env=env
        )


@ray.remote
class EngineServerActor:
    """One model server on the node Ray placed this actor on; `start` launches it (a method, not ``__init__``:
    an error raised there reaches the driver as itself, not as Ray's actor-died error)."""

    def __init__(self) -> None:
        self.group = None

    def start(
        self,
        cfg: EngineConfig,
        model_path: str,
        dtype: str,
        log_dir: str,
        index: int,
        weights_dir: str | None,
        admin_key: str | None = None,
    ) -> str:
        """Launch the server and wait until it is healthy; its address. ``admin_key``: the run's key, which
        serve-model wants on its control routes (in its environment)."""
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPUs (ray.engine_server_gpus), so the server is placed
        # already (no engine.gpus) and an SGLang server counts from GPU 0 (index 0);
        # a serve-model actor has its node's share to itself: its decode thread takes all the cores torch sees
        cfg = replace(cfg, host=host, cpu_threads=0, gpus=[])
        weights = Path(weights_dir) if weights_dir else None
        self.group = launch_servers(
            cfg, model_path, dtype, log_dir=log_dir, weights_dir=weights, admin_key=admin_key, ports=[port],
            first_index=index, spawn=_spawn,
        )  # fmt: skip
        return self.group.addresses[0]

    def restarts(self) -> int:
        return len(self.group.supervisor.restarts) if self.group and self.group.supervisor else 0

    def stop(self) -> None:
        if self.group is not None:
            self.group.stop()


def check_server_gpus(cfg: EngineConfig, gpus: float) -> None:
    """Fail before any actor starts when the GPUs a server actor reserves cannot hold its server: SGLang
    needs ``engine.tp`` of them (or a share of one at tp 1); vLLM on GPUs likewise; ``engine.gpus`` is the
    launcher without Ray's placement (under Ray, the reservation places each server)."""
    if cfg.gpus:
        raise ConfigError(
            f"engine.gpus={cfg.gpus}: places servers of a run without Ray; with launcher=ray, each server actor "
            "reserves ray.engine_server_gpus and Ray picks its GPUs: leave engine.gpus empty"
        )
    needs_gpus = cfg.backend == "sglang" or (cfg.backend == "vllm" and gpus > 0)
    if needs_gpus and not (gpus >= cfg.tp or (cfg.tp == 1 and gpus > 0)):
        raise ConfigError(
            f"ray.engine_server_gpus={gpus:g}: each {cfg.backend} server needs engine.tp={cfg.tp} GPUs "
            f"(a fraction of one at tp 1); set ray.engine_server_gpus={cfg.tp}"
        )


class EngineServers:
    """The model servers of one policy (`Servers`); ``stop()`` like a local `ServerGroup`."""

    supervisor = None  # each server's actor restarts its own server (`EngineServerActor`): none from the driver

    def __init__(
        self,
        cfg: EngineConfig,
        model_path: str,
        dtype: str,
        log_dir: Path,
        cpus: float,
        gpus: float,
        weights_dir: Path | None = None,
        admin_key: str | None = None,
    ):
        """``weights_dir``: where the run writes weight updates (default: ``engine_weights`` beside ``log_dir``);
        ``gpus``: what each server actor reserves (``ray.engine_server_gpus``, checked by `check_server_gpus`)."""
        check_server_gpus(cfg, gpus)
        options = {"num_cpus": cpus, "num_gpus": gpus}
        weights = str(weights_dir or Path(log_dir).parent / "engine_weights")
        self.actors = [EngineServerActor.options(**options).remote() for _ in range(cfg.num_servers)]
        self.admin_key = admin_key
        starts = [
            a.start.remote(cfg, model_path, dtype, str(log_dir), i, weights, admin_key)
            for i, a in enumerate(self.actors)
        ]
        try:
            self.addresses: list[str] = ray.get(starts)
        except BaseException as e:
            self.stop()  # the servers that did start, too
            if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, ArealAgentsError):
                raise e.cause from None  # one line from the CLI (a missing engine.vllm_python, a server's log tail)
            raise

    def stop(self) -> None:
        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass
            ray.kill(actor)
        self.actors = []
