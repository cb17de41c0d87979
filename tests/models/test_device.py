"""The GPU kind's dense bf16 peak (the most specific name wins) and the per-update GPU memory peak."""

import pytest
import torch

from areal_agents.models.device import gpu_memory, peak_tflops, reset_peak_memory, table_tflops


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),  # SXM
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H20", 148.0),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A10G", 70.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA GB200", 2500.0),
        ("NVIDIA B200", 2250.0),
        ("Tesla T4", None),
    ],
)
def test_the_most_specific_gpu_name_gives_the_peak(name, tflops):
    assert table_tflops(name) == tflops


def test_a_configured_peak_wins_and_a_cpu_has_none():
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_tflops(torch.device("cpu"), 500.0) == 500.0


def test_peak_tflops_reads_the_gpu_name_mocked_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 PCIe")
    assert peak_tflops(torch.device("cuda", 0)) == 756.0


def test_the_memory_peak_is_reset_on_cuda_only_mocked_cuda(monkeypatch):
    reset = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset.append)
    reset_peak_memory(torch.device("cpu"))
    assert reset == [] and gpu_memory(torch.device("cpu")) == {}
    reset_peak_memory(torch.device("cuda", 1))
    assert reset == [torch.device("cuda", 1)]
