"""Model servers (serve-model on CPU, SGLang on GPU) as Ray actors, placed by the resources they ask
for; each actor runs the same server command the local launcher would and stops it when it goes."""

from __future__ import annotations

import ctypes
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import ray

from areal_agents.config import EngineConfig
from areal_agents.engines.launcher import ServerGroup, free_port, server_command, wait_healthy


def _die_with_parent() -> None:
    """In the server's process: SIGTERM it when the actor's process dies (no orphaned servers)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@ray.remote
class EngineServerActor:
    def __init__(self, cfg: EngineConfig, model_path: str, dtype: str, log_dir: str, index: int) -> None:
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPUs, so an SGLang server counts from GPU 0
        # a serve-model actor has its node's share to itself: its decode thread takes all the cores torch sees
        command = server_command(replace(cfg, host=host, cpu_threads=0), model_path, dtype, port, 0)
        log = Path(log_dir) / f"{cfg.backend}-{index}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
            )
        self.group = ServerGroup([f"http://{host}:{port}"], [proc], [log])
        try:
            wait_healthy(self.group, cfg.startup_timeout_s)
        except BaseException:
            self.group.stop()
            raise

    def url(self) -> str:
        return self.group.addresses[0]

    def stop(self) -> None:
        self.group.stop()


class EngineServers:
    """The model servers of one policy; ``stop()`` like a local `ServerGroup`."""

    def __init__(self, cfg: EngineConfig, model_path: str, dtype: str, log_dir: Path, cpus: float, gpus: float):
        options = {"num_cpus": cpus, "num_gpus": gpus}
        self.actors = [
            EngineServerActor.options(**options).remote(cfg, model_path, dtype, str(log_dir), i)
            for i in range(cfg.num_servers)
        ]
        self.addresses = ray.get([a.url.remote() for a in self.actors])

    def stop(self) -> None:
        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass
            ray.kill(actor)
        self.actors = []
