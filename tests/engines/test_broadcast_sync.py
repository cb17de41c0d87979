"""The weight-sync transports against real serve-model processes (issue 30, item 4): this test process is
the trainer. Broadcast: the whole SGLang protocol over gloo (group set-up, buckets in order, dtypes, the
version), a server joining late, a server dying mid-broadcast; disk: the bf16 sharded layout. After every
push the server's logprobs for a fixed prompt equal the trainer's forward pass (1e-4), and differ from the
old weights', so a transport that reports success while the server keeps its old weights fails here.
"""

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from areal_agents.config import EngineConfig, TrainConfig
from areal_agents.engines.broadcast_sync import BroadcastSync
from areal_agents.engines.local_servers import ServerGroup, launch_servers, server_command, wait_healthy
from areal_agents.engines.serving import Serving
from areal_agents.engines.sglang.client import SGLangEngine
from areal_agents.engines.supervisor import Supervisor
from areal_agents.engines.weight_sender import HeldWeights
from areal_agents.engines.weight_sync import DiskSync, write_weights
from areal_agents.models import load_model
from areal_agents.net import free_port
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.trainers.remote_policy import RemotePolicy
from areal_agents.trainers.trainer_process import PipeTransport
from areal_agents.types import GenRequest, SamplingParams
from tests.trainers.test_trainer_process import batch

pytestmark = pytest.mark.process

FAULTY = Path(__file__).parent / "faulty_broadcast_server.py"
PROMPT = [5, 17, 23, 42, 8, 9, 60, 3]
BUCKET_BYTES = 32 * 1024  # several buckets for the tiny model


class Trainer(HeldWeights):
    """The trainer's side of a push: a model whose weights change between pushes (a `WeightSource`)."""

    def __init__(self, model_dir, shard_bytes: int = 5 << 30) -> None:
        self.model = load_model(model_dir)
        self.shard_bytes = shard_bytes
        self.generator = torch.Generator().manual_seed(0)

    def step(self) -> None:
        """New weights, as an optimizer step would make them."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=self.generator) * 0.05)

    async def tensors(self) -> dict:
        return self.model.state_dict()

    async def save_weights(self, path, dtype=None) -> None:
        write_weights(self.model.state_dict(), path, dtype, shard_bytes=self.shard_bytes)


def served(url: str, n: int = 8) -> tuple[list[int], list[float], str]:
    """(tokens, logprobs, weight_version) of a greedy /generate of the fixed prompt on the server ``url``."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0}, "return_logprob": True}
    request = urllib.request.Request(
        url + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        meta = json.loads(r.read())["meta_info"]
    triples = meta["output_token_logprobs"]
    return [t[1] for t in triples], [t[0] for t in triples], meta["weight_version"]


def forward(model, tokens: list[int]) -> torch.Tensor:
    """The trainer's logprobs of ``tokens`` after the fixed prompt."""
    ids = PROMPT + tokens
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return logp[-len(tokens) :]


def assert_serves(url: str, model, version: int, old: list[float] | None = None) -> list[float]:
    """The server at ``url`` serves ``model``'s weights as ``version``: its logprobs equal a forward pass."""
    tokens, logprobs, name = served(url)
    assert name == str(version)
    assert torch.allclose(torch.tensor(logprobs), forward(model, tokens), atol=1e-4), (logprobs, forward(model, tokens))
    if old is not None:
        assert max(abs(a - b) for a, b in zip(logprobs, old)) > 1e-3, "the weights did not change"
    return logprobs


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=10) as r:
        return json.loads(r.read())


def start_server(command: list[str], url: str, log: Path) -> ServerGroup:
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    group = ServerGroup([url], [proc], [log])
    wait_healthy(group, 120)
    return group


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """One serve-model for the module; each test pushes its own weights to it."""
    group = launch_servers(
        EngineConfig(backend="serve-model"), str(tiny_dir), log_dir=tmp_path_factory.mktemp("logs"), supervise=False
    )
    yield group.addresses[0]
    group.stop()


def test_two_broadcast_pushes_leave_the_server_serving_the_trainers_weights(server, tiny_dir):
    trainer = Trainer(tiny_dir)
    engine = SGLangEngine([server])
    sync = BroadcastSync([engine], bucket_bytes=BUCKET_BYTES, timeout_s=30)
    before = served(server)[1]
    nbytes = sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values())
    try:
        for version in (1, 2):
            trainer.step()
            assert asyncio.run(sync.push(trainer)) == version
            before = assert_serves(server, trainer.model, version, old=before)
            assert sync.last_push["weight_sync_bytes"] == nbytes and sync.last_push["weight_sync_seconds"] > 0
            if version == 1:
                first_group = sync.groups[0][1].name
        assert sync.groups[0][1].name == first_group, "the group is made once and kept"
        assert engine.get_version() == 2 and engine.in_rotation() == [0]
        sync.dtype = "bfloat16"  # what a GPU run sends: the server (float32 here) holds the rounded weights
        trainer.step()
        assert asyncio.run(sync.push(trainer)) == 3 and sync.last_push["weight_sync_bytes"] == nbytes / 2
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        assert_serves(server, trainer.model, 3, old=before)
    finally:
        sync.close()
        asyncio.run(engine.aclose())


def test_a_trainer_process_broadcasts_its_weights_from_where_they_are(server, tiny_dir, tmp_path):
    """A trainer in a process of its own hosts the weight group as rank 0 and sends every bucket itself: the
    server serves the trained weights, and none passed through this process (the shared-memory copy this
    process would read them from was never refreshed). Pushed twice: the group is kept in the trainer."""
    cfg = TrainConfig()
    cfg.model.path, cfg.ppo.lr = str(tiny_dir), 1e-2
    spec = TrainSpec.of(cfg, pad_token_id=0)
    engine = SGLangEngine([server])
    sync = BroadcastSync([engine], bucket_bytes=BUCKET_BYTES, timeout_s=30)
    transport = PipeTransport.spawn(spec, "policy", str(tiny_dir), str(tiny_dir))
    policy = RemotePolicy("policy", spec, Serving(engine, sync, None), transport)
    untouched = {k: v.clone() for k, v in transport._shared.items()}  # noqa: SLF001  (what `tensors()` would read)
    trajectories = batch(load_model(tiny_dir).config.vocab_size)
    try:
        before = served(server)[1]
        for version in (1, 2):
            asyncio.run(policy.update(trajectories, torch.Generator().manual_seed(version)))
            asyncio.run(policy.push_weights())
            policy.save_checkpoint(tmp_path / f"v{version}")  # the trainer's weights, written by the trainer
            before = assert_serves(server, load_model(tmp_path / f"v{version}"), version, old=before)
            if version == 1:
                first_group = sync.groups[0][1].name
        assert sync.groups[0][1].name == first_group, "the group is made once and kept"
        assert all(torch.equal(transport._shared[k], v) for k, v in untouched.items())  # noqa: SLF001
    finally:
        sync.close()
        policy.close()
        asyncio.run(engine.aclose())


def test_a_server_joining_late_or_restarted_gets_the_weights_before_it_serves(server, tiny_dir, tmp_path):
    """Added late (not up at the first push), then killed and restarted by the supervisor (which brings it
    back with the checkpoint's weights: broadcast weights are not on disk): each time it takes no request
    until a push has given it the trainer's weights."""
    trainer = Trainer(tiny_dir)
    port = free_port()
    late = f"http://127.0.0.1:{port}"
    cfg = EngineConfig(backend="serve-model")
    group = ServerGroup([late])
    supervisor = Supervisor(
        group, lambda i, path, tokenizer, version: server_command(
            cfg, path, "float32", port, 1, tokenizer_path=tokenizer, weight_version=version
        ), str(tiny_dir), check_every_s=0.5,
    )  # fmt: skip
    engine = SGLangEngine([server, late], max_retries=0)
    sync = BroadcastSync([engine], bucket_bytes=BUCKET_BYTES, timeout_s=30, supervisor=supervisor)

    def generate_some() -> int:
        """Requests through the engine; the tokens the late server generated since it started."""

        async def run() -> None:
            for k in range(4):
                await engine.agenerate(GenRequest(f"ep{k}/t{time.monotonic()}", PROMPT, SamplingParams(4)))

        asyncio.run(run())
        return get(late, "/get_server_info")["engine"]["generated_tokens"]

    try:
        trainer.step()
        asyncio.run(sync.push(trainer))  # the late server is not up yet: it leaves the rotation
        assert engine.in_rotation() == [0] and 1 in engine.out
        started = start_server(server_command(cfg, str(tiny_dir), "float32", port, 1), late, tmp_path / "late.log")
        group.procs, group.logs = started.procs, started.logs
        assert generate_some() == 0, "no request before its weights"
        trainer.step()
        assert asyncio.run(sync.push(trainer)) == 2  # it joins this push's group
        assert engine.in_rotation() == [0, 1]
        assert_serves(late, trainer.model, 2)
        assert_serves(server, trainer.model, 2)

        group.supervisor = supervisor.start()
        group.procs[0].kill()
        deadline = time.monotonic() + 60
        while not supervisor.restarts and time.monotonic() < deadline:
            time.sleep(0.2)
        assert engine.in_rotation() == [0], "out as soon as the supervisor restarts it"
        assert wait_healthy(group, 60) is None
        assert generate_some() == 0
        trainer.step()
        assert asyncio.run(sync.push(trainer)) == 3 and engine.in_rotation() == [0, 1]
        assert_serves(late, trainer.model, 3)
    finally:
        sync.close()
        asyncio.run(engine.aclose())
        group.stop()


def test_a_server_dying_mid_broadcast_leaves_the_rotation_and_the_run_goes_on_simulated_fault(
    server, tiny_dir, tmp_path
):
    trainer = Trainer(tiny_dir)
    port = free_port()
    dying = f"http://127.0.0.1:{port}"
    group = start_server([sys.executable, str(FAULTY), str(tiny_dir), str(port)], dying, tmp_path / "dying.log")
    engine = SGLangEngine([server, dying], max_retries=0)
    timeout_s = 20.0
    sync = BroadcastSync([engine], bucket_bytes=BUCKET_BYTES, timeout_s=timeout_s)
    try:
        trainer.step()
        start = time.monotonic()
        assert asyncio.run(sync.push(trainer)) == 1
        assert time.monotonic() - start < timeout_s
        assert group.procs[0].wait(timeout=10) == 1, "it died in the second bucket"
        assert engine.in_rotation() == [0] and "failed a weight push" in engine.out[1]
        assert_serves(server, trainer.model, 1)

        async def generate_some() -> list:
            requests = [GenRequest(f"ep{k}/t0", PROMPT, SamplingParams(4)) for k in range(4)]
            return await asyncio.gather(*(engine.agenerate(r) for r in requests))

        got = asyncio.run(generate_some())  # sampled: a reply may end at an early end of sequence
        assert all(r.output_tokens and r.output_versions == [1] * len(r.output_tokens) for r in got), got
        trainer.step()
        assert asyncio.run(sync.push(trainer)) == 2, "the next push goes to the servers left"
        assert_serves(server, trainer.model, 2)
    finally:
        sync.close()
        asyncio.run(engine.aclose())
        group.stop()


def test_disk_sync_writes_bf16_shards_with_the_config_and_the_server_serves_them(server, tiny_dir, tmp_path):
    trainer = Trainer(tiny_dir, shard_bytes=64 * 1024)
    engine = SGLangEngine([server], weights_dir=str(tmp_path / "weights"))
    sync = DiskSync([engine], dtype="bfloat16", model_dir=tiny_dir)
    trainer.step()
    try:
        assert asyncio.run(sync.push(trainer, version=7)) == 7
    finally:
        asyncio.run(engine.aclose())
    path = tmp_path / "weights" / "v7"
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(trainer.model.state_dict()), "every tensor, lm_head too"
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    total = sum(t.numel() * 2 for t in trainer.model.state_dict().values())  # bf16: 2 bytes a value
    assert index["metadata"]["total_size"] == total <= sync.last_push["weight_sync_bytes"]
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert (path / "config.json").read_text() == (Path(tiny_dir) / "config.json").read_text()
    with torch.no_grad():  # the server (float32) holds the bf16-rounded weights
        for p in trainer.model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert_serves(server, trainer.model, 7)
