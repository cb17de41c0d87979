"""Start (or connect to) the model servers a run generates with, and build its engine and the weight sync
that feeds it (`open_weight_sync`, from ``engine.weight_sync``).

``engine.backend``: ``hf`` (in-process `HFEngine`), ``serve-model`` (our SGLang-protocol server in
subprocesses), ``sglang`` (``python -m sglang.launch_server`` on GPUs, from ``engine.sglang_python``:
`engines.sglang.server`) or ``vllm`` (vLLM's OpenAI-compatible server, from ``engine.vllm_python``:
`engines.vllm.server`); with ``engine.urls`` set, the run connects to running servers instead. Each server
gets its share of ``engine.gpus`` as ``CUDA_VISIBLE_DEVICES`` (disaggregated) or, with none named, sees the
trainer's GPUs (colocated); ``engine.dtype=auto`` is bfloat16 on a GPU (`engine_dtype`). Servers this
process started are waited for (``/health``), restarted with the run's current weights when one dies or
reports its engine failed (`Supervisor`), and stopped when the run ends or the process exits. A run's
serve-model servers (`open_engine`) get an admin key, ``AREAL_ADMIN_KEY`` or a generated one, in their
environment (off the command line), and the run's client and supervisor send it (`engines.server_control`).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from areal_agents import net
from areal_agents.config import EngineConfig, EngineOptions
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.broadcast_sync import BroadcastSync
from areal_agents.engines.server_control import ADMIN_KEY_ENV
from areal_agents.engines.sglang.server import sglang_command, sglang_python
from areal_agents.engines.supervisor import ServerGroup, Servers, Supervisor, spawn_server
from areal_agents.engines.vllm.server import checkpoint_dtype, vllm_command, vllm_python
from areal_agents.engines.weight_sync import DiskSync, InProcessSync, WeightSync
from areal_agents.errors import ConfigError, EngineError
from areal_agents.net import free_port, log_tail


def server_command(
    cfg: EngineConfig,
    model_path: str,
    dtype: str,
    port: int,
    index: int,
    *,
    tokenizer_path: str | None = None,
    weight_version: str | None = None,
    scratch: Path | None = None,
) -> list[str]:
    """The command line of server ``index`` of a launch (a restart names the tokenizer and weight_version;
    ``scratch``: a directory of the server's own for its temporary files, which vLLM needs). With
    ``engine.gpus`` it starts with ``env CUDA_VISIBLE_DEVICES=...``, its share of them (`server_gpus`)."""
    backend, host = cfg.backend, cfg.host
    if backend not in ("sglang", "serve-model", "vllm"):
        raise EngineError(
            f"engine.backend must be 'hf', 'serve-model', 'sglang' or 'vllm' to launch servers, got {backend!r}"
        )
    gpus = server_gpus(cfg, index)
    placement = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else {}
    dtype = engine_dtype(cfg, model_path, dtype)
    if backend == "sglang":
        # placed: it sees only its GPUs; colocated: it sees them all and takes engine.tp from index * tp on
        python = sglang_python(cfg)
        base_gpu_id = 0 if gpus else index * cfg.tp
        command = sglang_command(
            cfg, python, model_path, dtype, port, base_gpu_id=base_gpu_id, tokenizer_path=tokenizer_path,
            weight_version=weight_version,
        )  # fmt: skip
        return with_env(placement, command)
    if backend == "vllm":
        if scratch is None:
            raise EngineError("a vLLM server needs a scratch directory of its own (server_command(scratch=...))")
        python = vllm_python(cfg)
        return vllm_command(
            cfg, python, model_path, dtype, port, scratch, tokenizer_path=tokenizer_path, placement=placement
        )
    restart = ["--tokenizer-path", tokenizer_path] if tokenizer_path else []
    restart += ["--weight-version", weight_version] if weight_version is not None else []
    if cfg.max_lora_rank > 0:  # the run's adapters (`lora_serving`); else serve-model's own caps
        restart += ["--max-lora-rank", str(cfg.max_lora_rank), "--max-loras", str(cfg.max_loras)]
    return with_env(placement, [
        sys.executable, "-m", "areal_agents.cli", "serve-model", "--model-path", model_path, "--host", host,
        "--port", str(port), "--dtype", dtype, *engine_flags(cfg), "--device", server_device(cfg),
        *restart, *cfg.extra_args,
    ])  # fmt: skip


def engine_flags(options: EngineOptions) -> list[str]:
    """serve-model's flags for ``options`` (an `EngineConfig` is one): ``--field-name value``, ``--no-x``."""
    flags = []
    for f in dataclasses.fields(EngineOptions):
        value, flag = getattr(options, f.name), f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def with_env(variables: dict[str, str], command: list[str]) -> list[str]:
    """``env K=V ... command`` (on the command line, so a `Supervisor` restart sets them too)."""
    return ["env", *(f"{k}={v}" for k, v in variables.items()), *command] if variables else command


def gpus_per_server(cfg: EngineConfig) -> int:
    """GPUs one launched server takes: ``engine.tp`` for SGLang and vLLM, one for serve-model."""
    return 1 if cfg.backend == "serve-model" else cfg.tp


def server_gpus(cfg: EngineConfig, index: int) -> list[int]:
    """Server ``index``'s GPUs out of ``engine.gpus`` (disaggregated: `gpus_per_server` each, in order); empty
    when ``engine.gpus`` is (colocated: the servers see the trainer's GPUs). An error unless the list holds
    exactly ``engine.num_servers`` x that many distinct GPU ids."""
    if not cfg.gpus:
        return []
    per = gpus_per_server(cfg)
    need = cfg.num_servers * per
    if len(cfg.gpus) != need:
        raise ConfigError(
            f"engine.gpus: expects engine.num_servers x GPUs per server (engine.tp for sglang and vllm, 1 for "
            f"serve-model) = {cfg.num_servers} x {per} = {need} GPU ids, got {len(cfg.gpus)}: {cfg.gpus}"
        )
    if len(set(cfg.gpus)) != len(cfg.gpus) or min(cfg.gpus) < 0:
        raise ConfigError(f"engine.gpus: expects distinct GPU ids >= 0 (as nvidia-smi numbers them), got {cfg.gpus}")
    return list(cfg.gpus[index * per : (index + 1) * per])


def server_device(cfg: EngineConfig) -> str:
    """Where a launched server computes, ``cuda`` or ``cpu``: SGLang always on a GPU; serve-model and vLLM
    where ``engine.device`` says, ``auto`` being cuda when ``engine.gpus`` names GPUs or torch here sees one."""
    if cfg.backend == "sglang":
        return "cuda"
    if cfg.device != "auto":
        return cfg.device
    import torch  # noqa: PLC0415  (a launcher that starts no server needs no torch)

    return "cuda" if cfg.gpus or torch.cuda.is_available() else "cpu"


def engine_dtype(cfg: EngineConfig, model_path: str, run_dtype: str) -> str:
    """The dtype a launched server computes in: ``engine.dtype``; ``auto``: bfloat16 on a GPU
    (`server_device`: SGLang's and vLLM's attention kernels want 16 bits); on CPU the run's ``model.dtype``
    for serve-model and the checkpoint's own for vLLM (whose ``auto`` would make float32 float16)."""
    if cfg.dtype != "auto":
        return cfg.dtype
    if server_device(cfg) == "cuda":
        return "bfloat16"
    return run_dtype if cfg.backend == "serve-model" else checkpoint_dtype(model_path)


def launch_servers(
    cfg: EngineConfig,
    model_path: str,
    dtype: str = "float32",
    *,
    log_dir: str | Path | None = None,
    weights_dir: str | Path | None = None,
    supervise: bool = True,
    admin_key: str | None = None,
    ports: list[int] | None = None,
    first_index: int = 0,
    spawn: Callable[..., subprocess.Popen] = spawn_server,
) -> ServerGroup:
    """Start ``cfg.num_servers`` servers of ``cfg.backend`` for ``model_path`` (or one per port of ``ports``)
    and wait until all are healthy; with ``supervise``, a `Supervisor` restarts them with the weights last
    pushed to ``weights_dir``. ``admin_key``: serve-model's ``--admin-key``, given to each server in its
    environment (`ADMIN_KEY_ENV`). The one launch path: a Ray server actor starts its one server with it too
    (``first_index``: its number in the log's name; ``spawn``: how a process starts, ``spawn(command, log, env)``)."""
    since = time.time()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="areal-servers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = ports or [cfg.base_port + i if cfg.base_port else free_port(cfg.host) for i in range(cfg.num_servers)]
    group = ServerGroup([], admin_key=admin_key)
    atexit.register(group.stop)
    env = {**os.environ, ADMIN_KEY_ENV: admin_key} if admin_key else None  # None: this process's environment
    # short paths: vLLM's IPC sockets live there (a socket path has at most 107 bytes)
    scratch = [Path(tempfile.mkdtemp(prefix="areal-vllm-")) if cfg.backend == "vllm" else None for _ in ports]
    group.scratch += [path for path in scratch if path is not None]

    def command_for(i: int, path: str, tokenizer: str | None = None, version: str | None = None) -> list[str]:
        return server_command(
            cfg, path, dtype, ports[i], i, tokenizer_path=tokenizer, weight_version=version, scratch=scratch[i]
        )

    try:
        for i, port in enumerate(ports):
            command = command_for(i, model_path)  # an engine that cannot start fails here, before any log
            log = log_dir / f"{cfg.backend}-{first_index + i}.log"
            log.write_bytes(b"")
            group.procs.append(spawn(command, log, env))
            group.addresses.append(f"http://{cfg.host}:{port}")
            group.logs.append(log)
        wait_healthy(group, cfg.startup_timeout_s)
    except BaseException:
        group.stop()
        raise
    if supervise:
        weights = Path(weights_dir) if weights_dir else None
        group.supervisor = Supervisor(
            group, command_for, model_path, weights, startup_timeout_s=cfg.startup_timeout_s, since=since,
            failing_s=failing_s(cfg.backend), admin_key=admin_key,
            spawn=lambda command, log: spawn(command, log, env),
        ).start()  # fmt: skip
    return group


def failing_s(backend: str) -> float:
    """How long a server of ``backend`` may answer /health with 503 before it is restarted: serve-model's
    503 means its decode loop failed (final); SGLang's also comes while it starts or is paused for long."""
    return 0.0 if backend == "serve-model" else 120.0


def wait_healthy(group: ServerGroup, timeout_s: float) -> None:
    """Wait until every server's /health answers 200; fail with its log's tail if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    for i, address in enumerate(group.addresses):
        proc = group.procs[i] if i < len(group.procs) else None
        alive = (lambda p=proc: p.poll() is None) if proc is not None else (lambda: True)
        if net.wait_healthy(address, max(deadline - time.monotonic(), 0.0), alive=alive):
            continue
        if not alive():
            raise EngineError(
                f"model server {address} exited with code {proc.returncode} during start-up; "
                f"its log ({group.logs[i]}) ends:\n{log_tail(group.logs[i])}"
            )
        where = f"; log: {group.logs[i]}" if group.logs else ""
        raise EngineError(f"model server {address} not healthy after {timeout_s:.0f}s{where}")


def open_engine(cfg: EngineConfig, model_path: str, dtype: str, *, run_dir: Path, seed: int = 0):
    """The run's inference engine and the servers behind it (None for the in-process engine, which computes
    on ``engine.device``)."""
    if cfg.backend == "hf" and not cfg.urls:
        from areal_agents.engines.hf.engine import HFEngine  # noqa: PLC0415
        from areal_agents.engines.hf.process_engine import ProcessEngine  # noqa: PLC0415
        from areal_agents.models.loading import load_model  # noqa: PLC0415

        placement = dict(seed=seed, device=cfg.device, compute_dtype=cfg.dtype)
        if cfg.own_process:
            return ProcessEngine(model_path, dtype, cfg, **placement), None
        # weight_sync=in_process: the engine decodes with the trainer's own tensors (pushes copy nothing)
        share = cfg.weight_sync == "in_process"
        return HFEngine.of(load_model(model_path, dtype), cfg, share_weights=share, **placement), None
    if cfg.urls:
        servers = ServerGroup(list(cfg.urls))  # their admin key, if any: AREAL_ADMIN_KEY
    else:
        # serve-model's control routes take the run's own key: no other client pauses or reloads them
        key = (os.environ.get(ADMIN_KEY_ENV) or secrets.token_urlsafe(24)) if cfg.backend == "serve-model" else None
        servers = launch_servers(
            cfg, model_path, dtype, log_dir=run_dir / "servers", weights_dir=run_dir / "engine_weights", admin_key=key
        )
    return engine_client(cfg, servers.addresses, run_dir / "engine_weights", servers.admin_key), servers


def engine_client(
    cfg: EngineConfig, addresses: list[str], weights_dir: Path | None = None, admin_key: str | None = None
):
    """The client of ``addresses`` (`VLLMEngine` for ``engine.backend=vllm``, else `SGLangEngine`) with the
    config's timeout, retries and pause mode (``weights_dir``: where weight updates are written; ``admin_key``:
    the servers' admin key, default ``AREAL_ADMIN_KEY``)."""
    from areal_agents.engines.sglang.client import SGLangEngine  # noqa: PLC0415
    from areal_agents.engines.vllm.client import VLLMEngine  # noqa: PLC0415

    client = VLLMEngine if cfg.backend == "vllm" else SGLangEngine
    return client(
        addresses,
        weights_dir=str(weights_dir) if weights_dir else None,
        request_timeout_s=cfg.request_timeout_s,
        max_retries=cfg.max_retries,
        pause_mode=cfg.pause_mode,
        admin_key=admin_key,
    )


def open_weight_sync(
    cfg: EngineConfig, engine: InferenceEngine, servers: Servers | None, model_dir: str, dtype: str
) -> WeightSync:
    """The `WeightSync` ``engine.weight_sync`` names for ``engine`` (``servers``: those behind it,
    None for an engine in this process; ``model_dir``: the checkpoint whose config the servers load;
    ``dtype``: what disk and broadcast send, `wire_dtype`). ``auto``: in_process for an engine in this
    process, else disk."""
    kind = cfg.weight_sync
    if kind == "auto":
        kind = "in_process" if servers is None else "disk"
    if kind == "in_process":
        if servers is not None:
            raise ConfigError("engine.weight_sync=in_process: applies to an engine in this process, not servers")
        return InProcessSync([engine])
    if servers is None:
        raise ConfigError(f"engine.weight_sync={kind}: applies to model servers; this engine runs in this process")
    wire = wire_dtype(cfg, model_dir, dtype)
    if kind == "disk":
        return DiskSync([engine], dtype=wire, model_dir=model_dir)
    if kind == "broadcast":
        if cfg.backend == "vllm":
            raise ConfigError("engine.weight_sync=broadcast: speaks SGLang's protocol (sglang, serve-model), not vllm")
        return BroadcastSync(
            [engine],
            dtype=wire,
            bucket_bytes=cfg.weight_sync_bucket_mb * 1024**2,
            timeout_s=cfg.weight_sync_timeout,
            backend="gloo" if cfg.backend == "serve-model" else "auto",  # serve-model receives on its CPU
            tp_size=cfg.tp if cfg.backend == "sglang" else 1,
            supervisor=servers.supervisor,
        )
    raise ConfigError(f"engine.weight_sync: expects auto, disk, broadcast or in_process, got {kind!r}")


def wire_dtype(cfg: EngineConfig, model_dir: str, dtype: str | None) -> str | None:
    """The dtype new weights travel in to the servers: ``dtype``; ``auto``: the launched servers' own
    (`engine_dtype`: bfloat16 on a GPU, so a trainer's float32 master weights go as half the bytes), except
    serve-model on the CPU, which gets them as the trainer holds them (None)."""
    if dtype not in ("auto", "", None):
        return dtype
    if cfg.backend == "serve-model" and server_device(cfg) == "cpu":
        return None
    return engine_dtype(cfg, model_dir, "float32")
