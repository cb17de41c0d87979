"""The ``engine`` section: where rollouts are generated (`EngineConfig`), and `EngineOptions`, how the hf
engine batches and decodes, which serve-model's flags and an engine in its own process take too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from areal_agents.config.fields import check_positive, config_field


@dataclass
class EngineOptions:
    """How the hf engine batches and decodes: one type for the run's ``engine`` section, serve-model's flags
    (``--prefix-cache-tokens`` ...) and an engine in a process of its own."""

    max_running_requests: int = config_field("requests decoded together by the hf engine / serve-model", default=256)
    cpu_threads: int = config_field(
        "hf engine / serve-model: the decode thread's intra-op CPU threads; 0 = auto: 1 when rollouts overlap "
        "updates (max_staleness > 0: the trainer takes the rest), else the usable cores less one for the event "
        "loop (shared by launched servers); at most OMP_NUM_THREADS",
        default=0,
    )
    prefix_cache_tokens: int = config_field(
        "hf engine / serve-model: tokens of finished requests' KV kept for a next turn that extends them (0 = off)",
        default=65536,
    )
    stale_kv: Literal["recompute", "keep"] = config_field(
        "hf engine / serve-model, after a weight update: recompute running requests' KV cache with the new weights "
        "(AReaL: exact, re-prefills them) or keep the old weights' (PipelineRL's in-flight update: no re-prefill)",
        default="recompute",
    )
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16"] = config_field(
        "hf / serve-model: the KV cache's dtype (auto = the model's; bfloat16: docs/benchmarks.md)", default="auto"
    )
    fast_decode: bool = config_field(
        "hf engine / serve-model: decode and prefill Llama-family models with the engine's own step (q/k/v and "
        "gate/up fused: those weights held twice) instead of transformers' forward",
        default=True,
    )
    compile_decode: bool = config_field(
        "hf engine / serve-model: run fast_decode's decode step as torch.compile graphs, one per row bucket, "
        "compiled before the first step (seconds each; slower behind serve-model so far: docs/serve-model.md)",
        default=False,
    )

    def __post_init__(self) -> None:
        check_positive(self, "max_running_requests")
        check_positive(self, "cpu_threads", "prefix_cache_tokens", or_zero=True)


@dataclass
class EngineConfig(EngineOptions):
    backend: Literal["hf", "serve-model", "sglang", "vllm"] = config_field(
        "hf: in-process engine; serve-model / sglang / vllm: launch num_servers HTTP model servers", default="hf"
    )
    urls: list[str] = config_field("connect to these running servers of the backend instead", default_factory=list)
    num_servers: int = config_field("servers to launch", default=1)
    host: str = config_field("host the launched servers listen on", default="127.0.0.1")
    base_port: int = config_field("port of the first launched server (0: free ports)", default=0)
    tp: int = config_field("sglang / vllm: tensor-parallel GPUs per server", default=1)
    mem_fraction: float = config_field("sglang: --mem-fraction-static; vllm: --gpu-memory-utilization", default=0.8)
    extra_args: list[str] = config_field("more command-line flags for each launched server", default_factory=list)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = config_field(
        "servers' dtype; auto: bfloat16 on a GPU (sglang always), on CPU the checkpoint's (vllm) or model.dtype",
        default="auto",
    )
    vllm_python: str = config_field("vllm: Python of an env with vLLM (setup.sh --with-vllm: .venv-vllm)", default="")
    max_model_len: int = config_field("vllm: --max-model-len, the longest sequence (0: the model's)", default=0)
    pause_mode: Literal["abort", "keep"] = config_field(
        "servers, on a weight update: abort and resubmit requests (AReaL) or keep them (docs/vllm.md)", default="abort"
    )
    sglang_python: str = config_field(
        "sglang: Python of an env with SGLang (docs/sglang.md: setup.sh --with-sglang); empty: this one", default=""
    )
    device: Literal["auto", "cpu", "cuda"] = config_field(
        "hf engine / serve-model: its device (and so dtype auto for them and vllm); auto: cuda if torch sees one",
        default="auto",
    )
    gpus: list[int] = config_field(
        "GPUs set aside for the launched servers (disaggregated); empty: they share the trainer's (colocated)",
        default_factory=list,
    )
    weight_sync: Literal["auto", "disk", "broadcast", "in_process"] = config_field(
        "how new weights reach the engine; auto: in_process for the hf engine, disk for servers (docs/gpu.md)",
        default="auto",
    )
    weight_sync_timeout: float = config_field(
        "broadcast: seconds before a weight push to a server counts as failed (it leaves the rotation)", default=120.0
    )
    weight_sync_bucket_mb: int = config_field("broadcast: MiB of tensors sent in one bucket", default=512)
    own_process: bool = config_field(
        "hf engine: run it in a child process with its own GIL (requests and weights over a pipe); docs/benchmarks.md",
        default=False,
    )
    max_lora_rank: int = config_field(
        "launched vllm / sglang servers: serve LoRA adapters up to this rank (0: none; train sets it from model.lora)",
        default=0,
    )
    max_loras: int = config_field(
        "launched vllm / sglang servers: adapters held at once (train sets it to its LoRA policies)", default=1
    )
    startup_timeout_s: float = config_field("seconds to wait for a launched server's /health", default=600.0)
    request_timeout_s: float = config_field("seconds before a /generate call is retried", default=3600.0)
    max_retries: int = config_field("retries (exponential backoff) of a call on connection errors and 5xx", default=5)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "num_servers", "tp", "max_loras")
        check_positive(self, "max_lora_rank", or_zero=True)
        if self.own_process and (self.backend != "hf" or self.urls):
            raise ValueError("own_process: applies to the in-process hf engine (backend hf, no urls)")
        if self.pause_mode != "abort" and self.backend == "hf" and not self.urls:
            raise ValueError("pause_mode: applies to model servers; the in-process hf engine keeps requests (stale_kv)")
        check_positive(self, "max_model_len", or_zero=True)
        check_positive(self, "weight_sync_timeout", "weight_sync_bucket_mb")
        in_process = self.backend == "hf" and not self.urls
        if self.weight_sync == "in_process" and not in_process:
            raise ValueError("weight_sync: in_process applies to the in-process hf engine (backend hf, no urls)")
        if self.weight_sync in ("disk", "broadcast") and in_process:
            raise ValueError(f"weight_sync: {self.weight_sync} applies to model servers, not the in-process hf engine")
        if self.weight_sync == "broadcast" and self.backend == "vllm":
            raise ValueError(
                "weight_sync: broadcast speaks SGLang's update_weights_from_distributed (sglang, serve-model)"
            )


def broadcast_gpu_clash(engine: EngineConfig) -> str | None:
    """Why a weight broadcast from a trainer on CUDA in the run's own process to ``engine``'s servers cannot
    work, or None: colocated SGLang servers (``engine.gpus`` empty) start at GPU 0, where that trainer is
    (cuda:0), and NCCL refuses two ranks of one group on one GPU ("Duplicate GPU detected")."""
    if engine.weight_sync != "broadcast" or engine.backend != "sglang" or engine.urls or engine.gpus:
        return None
    return (
        "engine.weight_sync=broadcast to colocated SGLang servers (engine.gpus empty): server 0 starts on GPU 0, "
        "where the trainer is, and NCCL refuses two ranks of the weight group on one GPU (Duplicate GPU detected); "
        "set engine.gpus to engine.num_servers x engine.tp GPUs apart from the trainer's (engine.gpus=[1] beside "
        "a trainer on GPU 0), or use engine.weight_sync=disk"
    )
