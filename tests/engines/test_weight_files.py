"""The weight-sync pieces that need no server: `write_weights`' layouts, `open_weight_sync`'s choice, the
broadcast's buckets and group (two ranks in this process), and `RemoteEngine`'s rotation."""

import asyncio
import json
import threading

import pytest
import torch
from safetensors.torch import load_file

from areal_agents.config import EngineConfig
from areal_agents.engines.broadcast_group import join_group, plan_buckets, receive
from areal_agents.engines.broadcast_sync import BroadcastSync
from areal_agents.engines.local_servers import ServerGroup, open_weight_sync
from areal_agents.engines.sglang.client import SGLangEngine
from areal_agents.engines.supervisor import Restart, Served, Supervisor
from areal_agents.engines.vllm.client import check_reloadable
from areal_agents.engines.weight_sync import DiskSync, InProcessSync
from areal_agents.errors import ConfigError, EngineError
from areal_agents.models.weight_files import write_weights
from areal_agents.net import free_port


def state() -> dict:
    """Three float tensors of 400, 400 and 40 bytes and an int one; ``tied`` shares ``embed``'s storage."""
    embed = torch.arange(100, dtype=torch.float32)
    return {"embed": embed, "tied": embed, "norm": torch.ones(10), "steps": torch.tensor([3])}


def test_small_weights_are_one_model_safetensors_without_an_index(tmp_path):
    write_weights(state(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(loaded["tied"], torch.arange(100.0)) and loaded["steps"].dtype == torch.int64


def test_sharded_weights_have_an_index_and_take_the_dtype(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"an older single file")
    write_weights(state(), tmp_path, "bfloat16", shard_bytes=250)  # bf16: 200, 200, 20 bytes (+ 8 for steps)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "embed": "model-00001-of-00002.safetensors",
        "tied": "model-00002-of-00002.safetensors",
        "norm": "model-00002-of-00002.safetensors",
        "steps": "model-00002-of-00002.safetensors",
    }
    assert index["metadata"]["total_size"] == 200 + 200 + 20 + 8
    assert not (tmp_path / "model.safetensors").exists(), "no stale file beside the shards"
    second = load_file(str(tmp_path / "model-00002-of-00002.safetensors"))
    assert second["tied"].dtype == torch.bfloat16 and second["steps"].dtype == torch.int64
    check_reloadable(tmp_path)  # what vLLM's reload_weights reads: every shard


def test_a_bad_dtype_names_what_it_expects(tmp_path):
    with pytest.raises(ConfigError, match="expects a torch dtype name such as bfloat16, got 'bf17'"):
        write_weights(state(), tmp_path, "bf17")
    with pytest.raises(ConfigError, match="expects a torch dtype name such as bfloat16, got 'bf17'"):
        BroadcastSync([], dtype="bf17")


def test_open_weight_sync_picks_the_transport_the_config_names(tmp_path):
    servers = ServerGroup(["http://127.0.0.1:1"])
    engine = SGLangEngine(servers.addresses)
    auto, hf = EngineConfig(), EngineConfig(backend="serve-model")
    assert isinstance(open_weight_sync(auto, object(), None, str(tmp_path), "float32"), InProcessSync)
    disk = open_weight_sync(hf, engine, servers, str(tmp_path), "bfloat16")
    assert isinstance(disk, DiskSync) and disk.dtype == "bfloat16" and disk.model_dir == tmp_path
    cfg = EngineConfig(backend="serve-model", weight_sync="broadcast", weight_sync_bucket_mb=3, weight_sync_timeout=9)
    sync = open_weight_sync(cfg, engine, servers, str(tmp_path), "auto")
    assert isinstance(sync, BroadcastSync) and sync.backend == "gloo" and sync.dtype is None  # as the trainer's
    gpu = EngineConfig(backend="sglang", weight_sync="broadcast")
    assert open_weight_sync(gpu, engine, servers, str(tmp_path), "auto").dtype == "bfloat16", "the servers' dtype"
    assert sync.bucket_bytes == 3 << 20 and sync.timeout_s == 9
    with pytest.raises(ConfigError, match="engine.weight_sync=broadcast: applies to model servers"):
        open_weight_sync(EngineConfig(backend="sglang", weight_sync="broadcast"), engine, None, str(tmp_path), "auto")
    with pytest.raises(ConfigError, match="engine.weight_sync=in_process: applies to an engine in this process"):
        open_weight_sync(EngineConfig(weight_sync="in_process"), engine, servers, str(tmp_path), "auto")


def test_buckets_keep_the_order_and_a_large_tensor_goes_alone():
    tensors = {"a": torch.zeros(10), "b": torch.zeros(100), "c": torch.zeros(5), "d": torch.zeros(5)}
    assert plan_buckets(tensors, 100) == [["a"], ["b"], ["c", "d"]]  # 40, 400, 20 + 20 bytes
    assert plan_buckets(tensors, 1 << 20) == [["a", "b", "c", "d"]]


def test_a_group_broadcasts_in_order_outside_the_default_group():
    port = free_port()
    got = {}

    def server() -> None:
        group = join_group("127.0.0.1", port, rank=1, world_size=2, group_name="g", backend="gloo", timeout_s=20)
        got.update(receive(group, ["w", "b"], ["bfloat16", "int64"], [[2, 3], [4]]))
        group.close()

    thread = threading.Thread(target=server)
    thread.start()
    trainer = join_group("127.0.0.1", port, rank=0, world_size=2, group_name="g", backend="gloo", timeout_s=20)
    w, b = torch.randn(2, 3).to(torch.bfloat16), torch.arange(4)
    trainer.broadcast(w)
    trainer.broadcast(b)
    thread.join(timeout=20)
    trainer.close()
    assert torch.equal(got["w"], w) and torch.equal(got["b"], b)
    assert not torch.distributed.is_initialized(), "the default process group is left alone"
    with pytest.raises(EngineError, match="backend: expects one of"):
        join_group("127.0.0.1", port, rank=0, world_size=2, group_name="g", backend="mpi", timeout_s=1)


def test_servers_out_of_the_rotation_get_no_requests_and_a_restart_takes_one_out():
    engine = SGLangEngine(["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"])
    supervisor = Supervisor(ServerGroup(list(engine.addresses)), lambda *_: [], "m")  # not started: restarts by hand
    engine.guard_restarts(supervisor)
    engine.take_out(1, "failed a weight push")
    assert {engine._server_for(f"ep{k}/t0") for k in range(6)} == {0, 2}
    sticky = engine._server_for("ep0/t1")
    supervisor.restarts.append(Restart(sticky, "its process exited", Served("m"), 1, "exited", 0.0))
    assert engine.in_rotation() == sorted({0, 2} - {sticky})
    assert engine._server_for("ep0/t2") not in (1, sticky), "its episode moves on"
    engine.put_back(1)
    assert 1 in engine.in_rotation()
    engine.take_out(0, "x")
    engine.take_out(1, "y")
    engine.take_out(2, "z")
    with pytest.raises(EngineError, match="every server is out of the rotation"):
        engine._server_for("ep9/t0")
    asyncio.run(engine.aclose())
