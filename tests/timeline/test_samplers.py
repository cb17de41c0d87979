"""The samplers: a process's CPU use as a gauge; GPUs through NVML (mocked: no GPU here)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from areal_agents.timeline.reader import read_timeline
from areal_agents.timeline.recorder import Timeline
from areal_agents.timeline.samplers import watch_cpu, watch_gpus


class FakeNvml:
    """NVML's calls the sampler makes, for two GPUs at 40% and 90%."""

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=[40, 90][h])

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=(h + 1) * 2**30)


def test_gpus_are_rows_and_memory_gauges_mocked_nvml(tmp_path):
    tl = Timeline(tmp_path / "timeline", "driver")
    assert watch_gpus(tl, FakeNvml()) == 2
    tl.sample()
    tl.close()
    run = read_timeline(tmp_path)
    assert run.busy_share("gpu0") == 0.4 and run.busy_share("gpu1") == 0.9
    assert np.nanmax(run.gauges["gpu1/memory_gib"]) == 2.0


def test_nvml_without_a_driver_watches_nothing(tmp_path):
    class NoDriver(FakeNvml):
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    tl = Timeline(tmp_path / "timeline", "driver")
    assert watch_gpus(tl, NoDriver()) == 0
    tl.close()


def test_cpu_use_is_the_cores_this_process_kept_busy(tmp_path):
    tl = Timeline(tmp_path / "timeline", "driver")
    watch_cpu(tl, "driver")
    sum(i * i for i in range(2_000_000))  # some CPU work between two samples
    tl.sample()
    tl.close()
    cores = read_timeline(tmp_path).gauges["cpu/driver"]
    assert np.nanmax(cores) > 0
