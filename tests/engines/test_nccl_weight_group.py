"""A weight group over NCCL raises where gloo raises (issue 50, item 5): its process group is made with blocking
wait and CleanUpOnly error handling, so a server that dies mid-push fails the broadcast's wait and aborts only
that group's communicators; the trainer lives on to push to the servers left (the gloo twin in
test_broadcast_sync.py runs that failover). No NCCL here: its process group is a stand-in (mocked, as named)."""

import os

import pytest
import torch

from areal_agents.engines import broadcast_group
from areal_agents.engines.broadcast_group import NCCL_WEIGHT_GROUP_ENV, join_group
from areal_agents.net import free_port

pytestmark = pytest.mark.process  # rank 0 hosts the group's TCPStore (a listening socket, in C++)


class RecordingNCCL:
    """Stands in for ProcessGroupNCCL: records the environment its constructor reads, and aborts."""

    made: list[dict] = []

    class Options:
        _timeout = None

    def __init__(self, store, rank, world_size, options) -> None:
        RecordingNCCL.made.append({key: os.environ.get(key) for key in NCCL_WEIGHT_GROUP_ENV})
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_an_nccl_weight_group_raises_and_aborts_only_itself_mocked_nccl(monkeypatch):
    monkeypatch.setattr(torch.distributed, "ProcessGroupNCCL", RecordingNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the user's (or torch's default) for other groups
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    RecordingNCCL.made.clear()
    group = join_group("127.0.0.1", free_port(), rank=0, world_size=1, group_name="w", backend="nccl", timeout_s=5)
    assert RecordingNCCL.made == [{"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}]
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ
    pg = group.pg
    group.close()  # peers still waiting fail at once: the communicators abort
    assert pg.aborted and group.pg is None


def test_the_environment_is_put_back_when_the_group_cannot_be_made_mocked_nccl(monkeypatch):
    def refuse(*args):
        raise RuntimeError("no GPU")

    monkeypatch.setattr(torch.distributed, "ProcessGroupNCCL", type("NCCL", (RecordingNCCL,), {"__init__": refuse}),
                        raising=False)  # fmt: skip
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    with pytest.raises(RuntimeError, match="no GPU"):
        join_group("127.0.0.1", free_port(), rank=0, world_size=1, group_name="w", backend="nccl", timeout_s=5)
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ
    assert broadcast_group._environ_lock.acquire(blocking=False)  # noqa: SLF001  (released)
    broadcast_group._environ_lock.release()  # noqa: SLF001
