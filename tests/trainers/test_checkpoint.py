"""A checkpoint resumes on another host: tensors saved from a GPU load onto the CPU, and the RNG states
(CPU, numpy, Python, and each GPU's) come back as they were saved."""

import contextlib
import random

import numpy as np
import pytest
import torch

from areal_agents.trainers import checkpoint
from areal_agents.trainers.checkpoint import add_train_state, load_trainer_state, save_checkpoint


@contextlib.contextmanager
def _saved_as_on_cuda(monkeypatch):
    """Within the block ``torch.save`` records every storage's location as ``cuda:0``, byte for byte what a
    GPU trainer's file holds; loading such a file without a ``map_location`` needs that GPU."""
    with monkeypatch.context() as m:
        registry = [(0, lambda storage: "cuda:0", lambda storage, location: None)]
        m.setattr(torch.serialization, "_package_registry", registry + torch.serialization._package_registry)
        yield


def _optimizer_state():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones(3)
    optimizer.step()
    return param, optimizer


def test_a_checkpoint_saved_from_a_gpu_resumes_on_a_host_without_one(tmp_path, monkeypatch):
    param, optimizer = _optimizer_state()
    with _saved_as_on_cuda(monkeypatch):
        ckpt = save_checkpoint(tmp_path, 1, {}, None, {"ledger": torch.arange(4)})
        add_train_state(ckpt / "trainer_state.pt", {"optimizer": optimizer.state_dict()})
    with pytest.raises(RuntimeError, match="CUDA"):  # the file really claims a GPU: a plain load needs one
        torch.load(ckpt / "trainer_state.pt", weights_only=False)
    add_train_state(ckpt / "trainer_state.pt", {"scheduler": {"last_epoch": 1}}, key="critic")  # read to add
    state = load_trainer_state(ckpt)
    assert state["ledger"].device.type == "cpu" and state["ledger"].tolist() == [0, 1, 2, 3]
    resumed = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    resumed.load_state_dict(state["optimizer"])  # casts each state to its parameter's device
    want = optimizer.state_dict()["state"][0]
    got = resumed.state_dict()["state"][0]
    assert torch.equal(got["exp_avg"], want["exp_avg"]) and got["exp_avg"].device == param.device
    assert state["policies"]["critic"] == {"scheduler": {"last_epoch": 1}}


def test_the_rngs_come_back_as_saved(tmp_path):
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    ckpt = save_checkpoint(tmp_path, 1, {}, None, {})
    want = (torch.rand(2), np.random.rand(2), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    load_trainer_state(ckpt)
    got = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]


class _FakeCuda:
    """torch.cuda of a host with ``count`` GPUs, whose RNG states are recorded (no GPU here)."""

    def __init__(self, monkeypatch, count):
        self.states = [torch.tensor([7 * i], dtype=torch.uint8) for i in range(count)]
        self.restored = None
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(self.states))
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: setattr(self, "restored", states))


def test_each_gpus_rng_is_saved_and_restored_mocked_cuda(tmp_path, monkeypatch):
    cuda = _FakeCuda(monkeypatch, 2)
    ckpt = save_checkpoint(tmp_path, 1, {}, None, {})
    load_trainer_state(ckpt)
    assert [t.tolist() for t in cuda.restored] == [[0], [7]]


@pytest.mark.parametrize("count", [0, 1])
def test_gpu_rngs_are_left_alone_on_a_host_with_other_gpus_mocked_cuda(tmp_path, monkeypatch, caplog, count):
    _FakeCuda(monkeypatch, 2)
    ckpt = save_checkpoint(tmp_path, 1, {}, None, {})
    other = _FakeCuda(monkeypatch, count)
    load_trainer_state(ckpt)  # no error: the GPUs' generators stay as seeded
    assert other.restored is None and "CUDA RNG states of 2 GPUs not restored" in caplog.text


def test_a_checkpoint_without_gpu_rngs_resumes_on_a_gpu_host_mocked_cuda(tmp_path, monkeypatch):
    ckpt = save_checkpoint(tmp_path, 1, {}, None, {})  # a CPU run's (or an older) checkpoint
    cuda = _FakeCuda(monkeypatch, 1)
    assert "cuda" not in load_trainer_state(ckpt)["rng"] and cuda.restored is None


def test_on_cpu_keeps_the_structure():
    state = {"a": [torch.ones(1), (2, "x")], "b": {"c": torch.zeros(2)}}
    out = checkpoint.on_cpu(state)
    assert type(out["a"]) is list and out["a"][1] == (2, "x") and torch.equal(out["b"]["c"], torch.zeros(2))
