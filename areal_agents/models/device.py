"""Where a trainer or an engine computes: ``auto | cpu | cuda`` resolved once, the compute dtype that goes
with it, the GPU's memory figures and its dense peak (for MFU).

On CUDA the weights and the optimizer state stay float32 (master weights) and the forward and backward
run in bfloat16 (FSDP2's mixed-precision policy, or autocast when not sharded); on CPU everything stays
float32, exactly as before.

    device = resolve_device("auto")            # cuda:LOCAL_RANK when torch sees a GPU, else cpu
    with autocast(device, compute_dtype(device, "auto")):
        logits = model(input_ids.to(device)).logits
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from areal_agents.errors import ConfigError

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from the vendors' data sheets (half the "with
# sparsity" figure where only that is printed). The longest name contained in torch.cuda.get_device_name()
# wins: "NVIDIA H100 PCIe" is the PCIe card's, "NVIDIA L40S" not the L40's nor the L4's. ppo.peak_tflops
# overrides (scripts/gpu_check.sh measures it).
PEAK_BF16_TFLOPS = {
    "GB200": 2500.0,
    "B200": 2250.0,
    "H200": 989.0,
    "H100": 989.0,  # SXM ("NVIDIA H100 80GB HBM3")
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H800": 989.0,
    "H20": 148.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
    "4090": 165.0,
}


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """``cpu``, ``cuda`` or ``auto`` (cuda when torch sees a GPU) as a device; on CUDA the GPU of
    ``local_rank`` (default: ``LOCAL_RANK`` of the environment, else 0). `ConfigError` for cuda without one."""
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device: expects 'auto', 'cpu' or 'cuda', got {name!r}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device: cuda asked for, but torch sees no GPU (torch.cuda.is_available() is False)")
    rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    return torch.device("cuda", rank % torch.cuda.device_count())


def compute_dtype(device: torch.device, name: str = "auto") -> torch.dtype:
    """The forward/backward dtype: ``float32`` or ``bfloat16``; ``auto`` is bfloat16 on CUDA, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in ("float32", "bfloat16"):
        raise ConfigError(f"compute_dtype: expects 'auto', 'float32' or 'bfloat16', got {name!r}")
    return torch.bfloat16 if name == "bfloat16" else torch.float32


@contextlib.contextmanager
def autocast(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """``torch.autocast`` to ``dtype`` on ``device``; nothing at all for float32 (the CPU path is unchanged)."""
    if dtype == torch.float32:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


def gpu_memory(device: torch.device) -> dict[str, float]:
    """``perf/gpu_memory_*`` in GiB: allocated now, reserved now, and the peak allocated since the last
    `reset_peak_memory` (an update resets it as it starts: the update's peak, with whatever else this
    process allocated meanwhile, e.g. an engine in it); empty off CUDA."""
    if device.type != "cuda":
        return {}
    gib = 2.0**30
    return {
        "perf/gpu_memory_allocated_gib": torch.cuda.memory_allocated(device) / gib,
        "perf/gpu_memory_reserved_gib": torch.cuda.memory_reserved(device) / gib,
        "perf/gpu_memory_peak_gib": torch.cuda.max_memory_allocated(device) / gib,
    }


def reset_peak_memory(device: torch.device) -> None:
    """Start ``device``'s peak-allocated count afresh (`gpu_memory`'s ``perf/gpu_memory_peak_gib``); nothing
    off CUDA."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_tflops(device: torch.device, configured: float = 0.0) -> float | None:
    """The device's dense bf16 peak: ``configured`` when set, else the GPU kind's from `PEAK_BF16_TFLOPS`
    (`table_tflops`); None on CPU or an unknown GPU (no MFU is reported then)."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    return table_tflops(torch.cuda.get_device_name(device))


def table_tflops(name: str) -> float | None:
    """`PEAK_BF16_TFLOPS` of the longest kind contained in the GPU name ``name`` (None: no kind is)."""
    kinds = [kind for kind in PEAK_BF16_TFLOPS if kind in name]
    return PEAK_BF16_TFLOPS[max(kinds, key=len)] if kinds else None
