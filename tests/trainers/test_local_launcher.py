"""`LocalLauncher` refuses, before any server starts, a weight broadcast NCCL would refuse (issue 50, item 1):
a trainer in the run's process whose ``ppo.device=auto`` resolves to CUDA beside colocated SGLang servers.
No GPU here: the tests named ``..._mocked_cuda`` make torch report one."""

import pytest
import torch

from areal_agents.config import TrainConfig, load_config
from areal_agents.errors import ConfigError
from areal_agents.trainers.local_launcher import LocalLauncher, check_broadcast_placement
from areal_agents.trainers.policy_api import TrainSpec

BROADCAST_TO_COLOCATED_SGLANG = ["engine.backend=sglang", "engine.weight_sync=broadcast", "ppo.device=auto"]


def mock_one_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_an_auto_trainer_on_cuda_beside_colocated_sglang_is_refused_before_any_server_starts_mocked_cuda(
    monkeypatch, tmp_path
):
    mock_one_gpu(monkeypatch)
    cfg = load_config(TrainConfig, None, [*BROADCAST_TO_COLOCATED_SGLANG, f"run_dir={tmp_path}"])
    launcher = LocalLauncher(cfg)
    started = []
    monkeypatch.setattr(launcher.serving, "open", lambda *a, **k: started.append(a))
    with pytest.raises(ConfigError, match=r"ppo.device=auto \(the trainer on cuda:0\): .*Duplicate GPU.*engine.gpus"):
        launcher.open_policy("policy", "model", "model", TrainSpec.of(cfg, pad_token_id=0))
    assert started == [], "a server was started before the refusal"


def test_placements_that_work_are_let_through_mocked_cuda(monkeypatch):
    mock_one_gpu(monkeypatch)
    for extra in (["engine.gpus=[1]"], ["ppo.trainer=process"], ["engine.weight_sync=disk"]):
        check_broadcast_placement(load_config(TrainConfig, None, [*BROADCAST_TO_COLOCATED_SGLANG, *extra]))


def test_a_cpu_trainer_broadcasts_over_gloo_and_is_let_through():
    if torch.cuda.is_available():
        pytest.skip("auto resolves to cuda on this machine")
    check_broadcast_placement(load_config(TrainConfig, None, BROADCAST_TO_COLOCATED_SGLANG))
