"""What a process samples besides its workers' busy time: its CPU use (cores busy) and, where a GPU exists,
each GPU's utilisation and memory through NVML (``nvidia-ml-py``), read on the timeline's sampler thread.

Example::

    tl = open_timeline(run_dir, "driver")
    watch_cpu(tl, "driver")   # gauge cpu/driver: cores this process kept busy, per bin
    watch_gpus(tl)            # rows gpu0, gpu1, ... (utilisation) and gauges gpuI/memory_gib
"""

from __future__ import annotations

import time
from typing import Any

from areal_agents.timeline.recorder import NullTimeline, Timeline


def watch_cpu(tl: Timeline | NullTimeline, process: str) -> None:
    """Gauge ``cpu/PROCESS``: the cores this process kept busy since the last sample (all its threads)."""
    last = [time.process_time(), time.monotonic()]

    def cores() -> float:
        cpu, wall = time.process_time(), time.monotonic()
        busy = (cpu - last[0]) / max(wall - last[1], 1e-6)
        last[:] = [cpu, wall]
        return busy

    tl.gauge(f"cpu/{process}", cores)


def watch_gpus(tl: Timeline | NullTimeline, nvml: Any = None) -> int:
    """Rows ``gpuI`` (NVML's utilisation, 0..1) and gauges ``gpuI/memory_gib`` for each GPU NVML sees; the
    number watched (0 without a GPU or without ``nvidia-ml-py``, which is then named once)."""
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415  (nvidia-ml-py: GPU machines only)
        except ImportError:
            if _has_cuda():
                print("timeline: no GPU utilisation without nvidia-ml-py (pip install nvidia-ml-py)", flush=True)
            return 0
    try:
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
    except Exception:  # noqa: BLE001  (NVML present but no driver or no GPU: nothing to watch)
        return 0
    for i in range(count):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        tl.busy_fraction(f"gpu{i}", lambda h=handle: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100)
        tl.gauge(f"gpu{i}/memory_gib", lambda h=handle: nvml.nvmlDeviceGetMemoryInfo(h).used / 2**30)
    return count


def _has_cuda() -> bool:
    try:
        import torch  # noqa: PLC0415

        return torch.cuda.is_available()
    except ImportError:
        return False
