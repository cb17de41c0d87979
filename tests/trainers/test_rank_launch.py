"""``ppo.nproc_per_node=2``: `LocalLauncher.open_policy` spawns two FSDP2 rank processes (gloo, torchrun's
environment) behind one `TrainablePolicy`; the engine stays in this process and serves rank 0's gathered weights."""

import asyncio

import pytest
import torch
from safetensors import safe_open

from areal_agents.config import TrainConfig
from areal_agents.engines.weight_sync import InProcessSync
from areal_agents.models import load_model
from areal_agents.trainers.local_launcher import LocalLauncher
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainablePolicy, TrainSpec
from areal_agents.trainers.remote_policy import RemotePolicy
from areal_agents.trainers.trainer_process import PipeTransport, rank_environments
from tests.trainers.test_trainer_process import batch


@pytest.mark.process
def test_two_rank_processes_train_push_and_checkpoint_as_one_process(tiny_dir, tmp_path):
    cfg = TrainConfig(run_dir=str(tmp_path))
    cfg.model.path = str(tiny_dir)
    cfg.ppo.lr, cfg.ppo.num_minibatches, cfg.ppo.nproc_per_node, cfg.ppo.cpu_threads = 1e-3, 2, 2, 2
    spec = TrainSpec.of(cfg, pad_token_id=0)
    trajectories = batch(load_model(tiny_dir).config.vocab_size)
    here = load_trainable("policy", spec, str(tiny_dir), str(tiny_dir))
    expected = here.train_step(trajectories, torch.Generator().manual_seed(5))

    policy = LocalLauncher(cfg).open_policy("policy", str(tiny_dir), str(tiny_dir), spec)
    try:
        assert isinstance(policy, RemotePolicy) and isinstance(policy, TrainablePolicy)
        assert isinstance(policy.transport, PipeTransport) and not policy.streams  # ranks take a batch whole
        assert len(policy.transport.processes) == 2  # one FSDP2 rank per process
        assert isinstance(policy.weight_sync, InProcessSync)
        stats = asyncio.run(policy.update(trajectories, torch.Generator().manual_seed(5)))
        asyncio.run(policy.push_weights())
        policy.save_checkpoint(tmp_path / "model")  # the ranks gather, rank 0 writes: this process holds no model
        trained = load_model(tmp_path / "model").state_dict()
        state = policy.state_dict()
        policy.load_state_dict(state)  # every rank takes the full state back into its shards
        assert policy.state_dict()["optimizer"]["state"][0]["exp_avg"].equal(state["optimizer"]["state"][0]["exp_avg"])
        # and trains on from it as the single process does: each rank counts its own steps (the ranks got the
        # state through one shared memory: stepping it as given would count each step twice)
        asyncio.run(policy.update(trajectories, torch.Generator().manual_seed(6)))
        resumed = policy.state_dict()
        trained_on = {k: v.clone() for k, v in asyncio.run(policy.tensors()).items()}
    finally:
        policy.close()
        asyncio.run(policy.engine.aclose())
    assert not any(p.is_alive() for p in policy.transport.processes)
    assert stats["optimizer_steps"] == expected["optimizer_steps"] == 2
    assert stats["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert stats["trained_tokens"] == expected["trained_tokens"]
    for key, value in here.model.state_dict().items():
        torch.testing.assert_close(trained[key], value, rtol=0, atol=1e-5, msg=key)
        assert torch.equal(policy.engine.model.state_dict()[key], trained[key]), key  # what the engine serves
    assert policy.engine.get_version() == 1
    here.save_checkpoint(tmp_path / "here")  # the ranks' checkpoint has the unsharded one's files: tied weights once
    assert saved_keys(tmp_path / "model") == saved_keys(tmp_path / "here")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == sorted(
        p.name for p in (tmp_path / "here").iterdir()
    )
    # the train state is the single-process layout: the unsharded trainer loads it as it is
    here.load_state_dict(state)
    assert state["scheduler"]["last_epoch"] == 2
    here.train_step(trajectories, torch.Generator().manual_seed(6))
    want = here.state_dict()
    assert resumed["scheduler"] == want["scheduler"] and resumed["scheduler"]["last_epoch"] == 4
    assert resumed["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
    for i, s in want["optimizer"]["state"].items():
        assert float(resumed["optimizer"]["state"][i]["step"]) == float(s["step"]) == 4, i  # 2 updates x 2 minibatches
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(resumed["optimizer"]["state"][i][key], s[key], rtol=1e-4, atol=1e-8, msg=key)
    for key, value in here.model.state_dict().items():
        torch.testing.assert_close(trained_on[key], value, rtol=0, atol=1e-5, msg=key)


def saved_keys(model_dir) -> set[str]:
    keys = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            keys |= set(f.keys())
    return keys


def test_each_rank_gets_torchruns_environment():
    envs = rank_environments(3, [])
    assert [e["RANK"] for e in envs] == [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"} and len({e["MASTER_PORT"] for e in envs}) == 1
    assert all(e["MASTER_ADDR"] == "127.0.0.1" for e in envs)
