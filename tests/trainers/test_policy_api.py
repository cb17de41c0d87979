"""The recipe's seams: every policy is a `TrainablePolicy`, every launcher a `Launcher`, and a weight sync
moves a policy's weights to real engines (in place, and through disk to a real serve-model) under a version."""

import asyncio
import importlib.util
import inspect
from typing import Protocol

import pytest
import torch

from areal_agents.config import EngineConfig, TrainConfig
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.local_servers import launch_servers
from areal_agents.engines.sglang.client import SGLangEngine
from areal_agents.engines.weight_sync import DiskSync, InProcessSync, WeightSource, WeightSync
from areal_agents.errors import ConfigError
from areal_agents.models import load_model
from areal_agents.trainers.local_launcher import LocalLauncher
from areal_agents.trainers.policy import Policy, load_trainable
from areal_agents.trainers.policy_api import Launcher, TrainablePolicy, TrainSpec
from areal_agents.trainers.rl_recipe import run_train
from areal_agents.trainers.trainer_process import ProcessPolicy
from areal_agents.types import GenRequest, SamplingParams


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


@pytest.mark.process  # imports Ray (DistributedPolicy)
def test_each_policy_class_implements_every_protocol_member():
    """Each class defines every method of `TrainablePolicy` (and its `WeightSource`), async where the protocol's
    is; ``name``, ``engine`` and ``weight_sync`` are set per instance."""
    classes = [Policy, ProcessPolicy]
    if importlib.util.find_spec("ray") is not None:
        from areal_agents.cluster.trainer_group import DistributedPolicy  # noqa: PLC0415

        classes.append(DistributedPolicy)
        assert not DistributedPolicy.streams  # the recipe never streams to it
    declared = protocol_methods(TrainablePolicy)
    assert {"update_part", "finish_update", "tensors", "save_weights", "adapter_config", "save_checkpoint"} <= set(
        declared
    )
    assert "model" not in declared  # a checkpoint is written where the weights live, not copied to the driver
    for cls in classes:
        missing = [name for name in declared if not hasattr(cls, name)]
        assert not missing, (cls, missing)
        wrong = [
            name for name, is_async in declared.items() if inspect.iscoroutinefunction(getattr(cls, name)) != is_async
        ]
        assert not wrong, (cls, wrong)
        assert isinstance(cls.streams, bool)
    assert Policy.streams and ProcessPolicy.streams


@pytest.mark.process  # imports Ray (DistributedPolicy)
def test_a_policy_that_takes_batches_whole_trains_the_parts_at_finish():
    """`update_part` of a non-streaming policy keeps the parts; `finish_update` is one `update` of them all."""
    pytest.importorskip("ray")
    from areal_agents.cluster.trainer_group import DistributedPolicy  # noqa: PLC0415

    seen = []

    async def update(trajectories, generator):
        seen.append(list(trajectories))
        return {"trained_trajectories": float(len(trajectories))}

    policy = DistributedPolicy.__new__(DistributedPolicy)  # no rank actors: only the parts' bookkeeping
    policy._parts, policy.update = [], update
    asyncio.run(policy.update_part(["a", "b"]))
    asyncio.run(policy.update_part(["c"]))
    assert asyncio.run(policy.finish_update(torch.Generator())) == {"trained_trajectories": 3.0}
    assert asyncio.run(policy.finish_update(torch.Generator())) == {"trained_trajectories": 0.0}  # none: a skip
    assert seen == [["a", "b", "c"], []]


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
