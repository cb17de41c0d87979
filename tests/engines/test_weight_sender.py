"""`TensorSender`, the sending rank of a weight broadcast: it sends over NCCL from a GPU whatever process it is
in (a trainer process's rank 0 included, whose weights the driver used to copy to its CPU and send over gloo),
says what it sends before any server is paused, and refuses a backend it does not know."""

import pytest
import torch

from areal_agents.engines.weight_sender import TensorSender
from areal_agents.errors import EngineError


def weights() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(3, 2), "b": torch.tensor([1.0, float("nan")]), "steps": torch.tensor([4])}


def test_a_sender_on_a_gpu_picks_nccl_and_one_on_the_cpu_gloo_unless_told():
    assert TensorSender().describe(weights(), None, "auto", device="cuda").backend == "nccl"
    assert TensorSender().describe(weights(), None, "auto", device="cpu").backend == "gloo"
    assert TensorSender().describe(weights(), None, "gloo", device="cuda").backend == "gloo"  # engine.weight_sync_*
    with pytest.raises(EngineError, match="expects auto, gloo or nccl, got 'mpi'"):
        TensorSender().describe(weights(), None, "mpi", device="cpu")


def test_what_is_sent_is_described_in_the_wire_dtype_with_the_nonfinite_named():
    described = TensorSender().describe(weights(), "bfloat16", "auto", device="cpu")
    assert {k: (t.dtype, tuple(t.shape), t.device.type) for k, t in described.wire.items()} == {
        "w": (torch.bfloat16, (3, 2), "meta"),
        "b": (torch.bfloat16, (2,), "meta"),
        "steps": (torch.int64, (1,), "meta"),  # integers keep their dtype
    }
    assert described.nonfinite == ["b"]


def test_leaving_a_group_it_never_joined_is_nothing():
    TensorSender().leave("areal_weights_1_abc")
