"""The recipe's seams: every policy is a `TrainablePolicy`, every launcher a `Launcher`, and a weight sync
moves a policy's weights to real engines (in place, and through disk to a real serve-model) under a version."""

import asyncio
import importlib.util
import inspect
from typing import Protocol

import pytest
import torch
from safetensors.torch import load_file

from areal_agents.config import EngineConfig, LoraConfig, TrainConfig
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.local_servers import launch_servers
from areal_agents.engines.serving import Serving
from areal_agents.engines.sglang.client import SGLangEngine
from areal_agents.engines.weight_sync import DiskSync, InProcessSync, WeightSource, WeightSync
from areal_agents.errors import ConfigError
from areal_agents.models import load_model
from areal_agents.trainers.local_launcher import LocalLauncher
from areal_agents.trainers.policy import Policy, load_trainable
from areal_agents.trainers.policy_api import Launcher, TrainablePolicy, TrainSpec
from areal_agents.trainers.remote_policy import RemotePolicy, TrainerTransport
from areal_agents.trainers.rl_recipe import run_train
from areal_agents.trainers.trainer_endpoint import TrainerEndpoint, UnknownTrainerCall
from areal_agents.trainers.trainer_process import PipeTransport
from areal_agents.types import GenRequest, SamplingParams
from tests.trainers.test_trainer_process import batch


def protocol_methods(protocol: type) -> dict[str, bool]:
    """Every method and property `protocol` declares (its own and its bases'), by name: whether it is async."""
    declared = {}
    for cls in reversed(protocol.__mro__):
        if cls.__dict__.get("_is_protocol") and cls is not Protocol:
            for name, value in vars(cls).items():
                if not name.startswith("_") and (callable(value) or isinstance(value, property)):
                    declared[name] = inspect.iscoroutinefunction(value)
    return declared


def moved_policy(tiny_dir) -> Policy:
    """A trainable policy whose weights differ from the checkpoint's (as after an update)."""
    cfg = TrainConfig()
    policy = load_trainable("policy", TrainSpec.of(cfg, pad_token_id=0), str(tiny_dir), str(tiny_dir))
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p, generator=torch.Generator().manual_seed(0)))
    return policy


def test_each_policy_class_implements_every_protocol_member():
    """Each class defines every method of `TrainablePolicy` (and its `WeightSource`), async where the protocol's
    is; ``name``, ``engine`` and ``weight_sync`` are set per instance."""
    declared = protocol_methods(TrainablePolicy)
    assert {"update_part", "finish_update", "tensors", "save_weights", "adapter_config", "save_checkpoint"} <= set(
        declared
    )
    assert "model" not in declared  # a checkpoint is written where the weights live, not copied to the driver
    for cls in (Policy, RemotePolicy):
        missing = [name for name in declared if not hasattr(cls, name)]
        assert not missing, (cls, missing)
        wrong = [
            name for name, is_async in declared.items() if inspect.iscoroutinefunction(getattr(cls, name)) != is_async
        ]
        assert not wrong, (cls, wrong)
    assert Policy.streams


@pytest.mark.process  # imports Ray (RayTransport)
def test_each_transport_implements_every_transport_member():
    """The trainer in processes (pipes) and on Ray ranks is one `RemotePolicy` over two transports."""
    pytest.importorskip("ray")
    from areal_agents.cluster.trainer_group import RayTransport  # noqa: PLC0415

    declared = protocol_methods(TrainerTransport)
    assert {"call", "acall", "weights", "wait_idle", "close"} <= set(declared)
    for cls in (PipeTransport, RayTransport):
        assert [n for n in declared if inspect.iscoroutinefunction(getattr(cls, n)) != declared[n]] == [], cls
    assert RayTransport.streams is False  # ranks take a batch whole: the recipe never streams to them


class DirectTransport:
    """A `TrainerTransport` test double: the `TrainerEndpoint` in this process, called directly (what the pipe
    and Ray transports carry, without their processes), recording each call."""

    def __init__(self, endpoint: TrainerEndpoint, streams: bool) -> None:
        self.endpoint, self.streams, self.calls = endpoint, streams, []

    def call(self, method, *args):
        self.calls.append(method)
        return self.endpoint.call(method, args)

    async def acall(self, method, *args):
        return self.call(method, *args)

    async def weights(self):
        return self.call("weights")

    async def wait_idle(self):
        pass

    def close(self):
        self.calls.append("close")


def remote_policy(tiny_dir, streams: bool, lora: bool = False) -> tuple[RemotePolicy, Policy]:
    cfg = TrainConfig()
    cfg.ppo.lr, cfg.ppo.num_minibatches = 1e-3, 1 if streams else 2  # streaming takes one minibatch
    if lora:
        cfg.model.lora = LoraConfig(r=4)
    spec = TrainSpec.of(cfg, pad_token_id=0)
    trainer = load_trainable("policy", spec, str(tiny_dir), str(tiny_dir))
    engine = HFEngine(load_model(tiny_dir))
    serving = Serving(engine, InProcessSync([engine]), None)
    return RemotePolicy("policy", spec, serving, DirectTransport(TrainerEndpoint(trainer), streams)), trainer


@pytest.mark.parametrize("streams", [True, False], ids=["streams", "whole-batches"])
def test_a_remote_policy_trains_pushes_and_checkpoints_as_the_trainer_does(tiny_dir, tmp_path, streams):
    """Parts go to the trainer as they come (streams) or wait for `finish_update` and go as one `update`; the
    generator's state comes back; pushes carry the trainer's weights; files are the trainer's to write."""
    policy, trainer = remote_policy(tiny_dir, streams)
    here, _ = remote_policy(tiny_dir, streams)
    trajectories = batch(load_model(tiny_dir).config.vocab_size)
    generator = torch.Generator().manual_seed(5)

    async def run():
        await policy.update_part(trajectories[:4])
        await policy.update_part(trajectories[4:])
        stats = await policy.finish_update(generator)
        await policy.push_weights()
        return stats

    stats = asyncio.run(run())
    expected = asyncio.run(here.update(trajectories, torch.Generator().manual_seed(5)))
    kinds = policy.transport.calls
    assert kinds == (["update_part", "update_part", "finish_update"] if streams else ["update"]) + ["weights"]
    assert stats["optimizer_steps"] == (1 if streams else 2) and stats["trained_trajectories"] == 12
    assert stats["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert not torch.equal(generator.get_state(), torch.Generator().manual_seed(5).get_state())  # handed back
    assert policy.engine.get_version() == 1
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(policy.engine.model.state_dict()[key], value), key
    asyncio.run(policy.save_weights(tmp_path / "w"))
    policy.save_checkpoint(tmp_path / "ckpt")
    torch.save({"step": 3}, tmp_path / "trainer_state.pt")
    policy.save_train_state(tmp_path / "trainer_state.pt")  # added to the checkpoint's state file
    assert load_model(tmp_path / "ckpt").state_dict().keys() == trainer.model.state_dict().keys()
    saved = torch.load(tmp_path / "trainer_state.pt", weights_only=False)
    assert saved["step"] == 3 and saved["scheduler"] == trainer.scheduler.state_dict()
    fresh, _ = remote_policy(tiny_dir, streams)  # no optimizer state yet
    fresh.load_train_state(tmp_path / "trainer_state.pt")  # read by the trainer, not sent from here
    assert fresh.state_dict()["scheduler"] == trainer.scheduler.state_dict()
    moments = fresh.state_dict()["optimizer"]["state"]
    for i, saved_moments in trainer.optimizer.state_dict()["state"].items():
        assert torch.equal(moments[i]["exp_avg"], saved_moments["exp_avg"]), i
    written = load_file(next((tmp_path / "w").glob("*.safetensors")))  # what a server's disk push loads
    assert all(torch.equal(written[k], v) for k, v in trainer.model.state_dict().items() if k in written)
    assert asyncio.run(policy.finish_update(generator))["trained_trajectories"] == 0.0  # nothing fed: a skip
    policy.close()
    assert policy.transport.calls[-1] == "close"


def test_a_remote_lora_policy_asks_its_adapter_config_once_and_the_endpoint_names_what_it_answers(tiny_dir):
    policy, trainer = remote_policy(tiny_dir, True, lora=True)
    assert policy.adapter_config() == trainer.adapter_config() and policy.adapter_config()["r"] == 4
    assert policy.transport.calls == ["adapter_config"]
    assert set(asyncio.run(policy.tensors())) == set(trainer.adapter.tensors())  # the adapter alone
    with pytest.raises(UnknownTrainerCall, match="not 'model'"):
        policy.transport.call("model")


def test_a_local_launcher_opens_a_policy_with_an_in_place_weight_sync(tiny_dir, tmp_path):
    cfg = TrainConfig(run_dir=str(tmp_path))
    cfg.model.path = str(tiny_dir)
    launcher = LocalLauncher(cfg)
    assert isinstance(launcher, Launcher)
    policy = launcher.open_policy("policy", str(tiny_dir), str(tiny_dir), TrainSpec.of(cfg, pad_token_id=0))
    try:
        assert isinstance(policy, Policy) and isinstance(policy, TrainablePolicy)
        assert isinstance(policy.weight_sync, InProcessSync) and isinstance(policy.weight_sync, WeightSync)
        assert isinstance(policy, WeightSource) and policy.spec.cpu_threads > 0  # the launcher filled it in
        assert launcher.env_backend() is None and launcher.episode_runner(policy) is None and launcher.stats() == {}
    finally:
        policy.close()
        asyncio.run(policy.engine.aclose())


def test_in_process_sync_swaps_the_weights_and_bumps_the_version(tiny_dir):
    policy = moved_policy(tiny_dir)
    engine = HFEngine(load_model(tiny_dir))
    policy.engine, policy.weight_sync = engine, InProcessSync([engine])

    async def run():
        await policy.push_weights()
        assert engine.get_version() == 1
        assert await policy.weight_sync.push(policy, version=5) == 5
        await policy.weight_sync.announce(7)
        await engine.aclose()

    asyncio.run(run())
    assert engine.get_version() == 7
    for key, value in policy.model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[key], value), key
    policy.close()


@pytest.mark.process
def test_disk_sync_has_a_real_serve_model_load_the_weights_and_tag_the_version(tiny_dir, tmp_path):
    """Each push writes ``vN``, the server generates with it (logprobs of the pushed weights, tokens tagged
    N) and older copies than N - 1 go; `announce` retags without loading."""
    policy = moved_policy(tiny_dir)
    group = launch_servers(EngineConfig(backend="serve-model"), str(tiny_dir), log_dir=tmp_path / "logs")
    engine = SGLangEngine(group.addresses, weights_dir=str(tmp_path / "weights"))
    sync = DiskSync([engine])
    prompt = [5, 6, 7, 8]

    async def generate():
        return await engine.agenerate(GenRequest("ep/t0", prompt, SamplingParams(3, temperature=0.0)))

    async def run():
        try:
            for _ in range(3):
                await sync.push(policy)
            reply = await generate()
            await sync.announce(9)
            return reply, await generate()
        finally:
            await engine.aclose()

    try:
        reply, announced = asyncio.run(run())
    finally:
        group.stop()
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v2", "v3"]
    assert reply.output_versions == [3] * 3 and announced.output_versions == [9] * 3
    with torch.no_grad():
        logits = policy.model(torch.tensor([prompt + reply.output_tokens])).logits[0].float()
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(reply.output_tokens)[:, None])
    assert torch.allclose(torch.tensor(reply.output_logprobs), logp.squeeze(1), atol=1e-4)


def test_open_launcher_picks_the_configured_one_and_names_a_missing_ray(monkeypatch):
    from areal_agents import cluster

    assert isinstance(cluster.open_launcher(TrainConfig()), LocalLauncher)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r"launcher=ray needs Ray, which is not installed: pip install"):
        cluster.open_launcher(TrainConfig(launcher="ray"))


def test_run_train_asks_for_the_launcher_a_ray_config_needs(tmp_path):
    with pytest.raises(ConfigError, match=r"launcher=ray: pass run_train\(\.\.\., launcher=open_launcher\(cfg\)\)"):
        run_train(TrainConfig(run_dir=str(tmp_path), launcher="ray"))
