"""Weight updates while a pause keeps requests (``engine.pause_mode=keep``; issue 50, item 2), against
serve-model's SGLang routes. SGLang's ``pause_generation`` mode ``in_place`` leaves the requests in its
scheduler; a weight update that asks for ``flush_cache`` (true by default, on /update_weights_from_disk as on
/update_weights_from_distributed) loads, then flushes, and the flush fails while requests are pending, which
SGLang's scheduler asserts. serve-model answers such an update 400 and loads nothing; the clients ask for
no flush in keep mode, and a kept request goes on with the new weights."""

import asyncio
import threading

import pytest
import torch
from app_in_thread import serving_app
from test_atomic_weight_updates import broadcast, call, join

from areal_agents.engines.broadcast_sync import BroadcastSync
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.model_server import ModelServerConfig, build_app
from areal_agents.engines.sglang.client import SGLangEngine
from areal_agents.engines.weight_sender import HeldWeights
from areal_agents.engines.weight_sync import DiskSync, write_weights
from areal_agents.models import load_model, load_tokenizer
from areal_agents.types import GenRequest, SamplingParams

pytestmark = pytest.mark.process

PROMPT = [5, 17, 23, 42, 8, 9, 60, 3]
GENERATE = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True}


class Trainer(HeldWeights):
    """A `WeightSource` whose weights differ from the served model's."""

    def __init__(self, model_dir, seed: int) -> None:
        self.model = load_model(model_dir)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)

    async def tensors(self) -> dict:
        return self.model.state_dict()

    async def save_weights(self, path, dtype=None) -> None:
        write_weights(self.model.state_dict(), path, dtype)


@pytest.fixture
def served(tiny_dir):
    """serve-model's app under uvicorn in this process: its URL and its engine (to see what it keeps)."""
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=[], num_threads=1)
    app = build_app(engine, load_tokenizer(tiny_dir), ModelServerConfig(model_path=str(tiny_dir)))
    with serving_app(app) as url:
        yield url, engine
    engine.close()


def wait_pending(engine: HFEngine, n: int) -> None:
    for _ in range(3000):
        if engine.num_pending == n:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"the server never held {n} pending requests: {engine.num_pending}")


def test_an_update_asking_for_a_flush_while_in_place_keeps_requests_is_refused_as_sglang_fails(
    served, tiny_dir, tmp_path
):
    url, engine = served
    state = Trainer(tiny_dir, seed=1).model.state_dict()
    write_weights(state, tmp_path / "new")
    assert call(url, "/pause_generation", {"mode": "in_place"})[0] == 200
    kept: dict = {}
    request = threading.Thread(target=lambda: kept.update(reply=call(url, "/generate", GENERATE)))
    request.start()
    wait_pending(engine, 1)

    disk = {"model_path": str(tmp_path / "new"), "weight_version": "v1"}  # flush_cache: SGLang's default, true
    status, reply = call(url, "/update_weights_from_disk", disk)
    assert status == 400 and reply["success"] is False, reply
    assert "flush_cache is true, but an in_place pause keeps 1 requests" in reply["message"]
    assert "send flush_cache: false" in reply["message"] and "nothing was loaded" in reply["message"]
    group = join(url, "keep-flush")
    status, reply = broadcast(url, group, state)  # its flush_cache defaults to true too
    group.close()
    assert status == 400 and "update_weights_from_distributed: flush_cache is true" in reply["message"], reply
    assert engine.get_version() == 0 and engine.num_pending == 1, "a refused update loaded nothing, kept the request"

    status, reply = call(url, "/update_weights_from_disk", {**disk, "flush_cache": False})
    assert status == 200 and reply["success"], reply
    assert call(url, "/continue_generation", {})[0] == 200
    request.join(60)
    assert kept["reply"][0] == 200 and kept["reply"][1]["meta_info"]["weight_version"] == "v1"


def test_an_update_that_aborts_the_kept_requests_first_may_flush(served, tiny_dir, tmp_path):
    url, engine = served
    write_weights(Trainer(tiny_dir, seed=2).model.state_dict(), tmp_path / "new")
    assert call(url, "/pause_generation", {"mode": "in_place"})[0] == 200
    request = threading.Thread(target=lambda: call(url, "/generate", GENERATE))
    request.start()
    wait_pending(engine, 1)
    body = {"model_path": str(tmp_path / "new"), "abort_all_requests": True}  # abort mode's update
    status, reply = call(url, "/update_weights_from_disk", body)
    assert status == 200 and reply["success"], reply  # nothing pending once aborted: the flush is valid
    assert call(url, "/continue_generation", {})[0] == 200
    request.join(60)


def test_keep_mode_pushes_by_broadcast_and_disk_go_through_while_a_request_is_kept(served, tiny_dir, tmp_path):
    """The clients' keep-mode pushes ask for no flush: each goes through with a request kept (queued) in the
    server, which then runs to its end on the weights pushed, not resubmitted."""
    url, engine = served
    client = SGLangEngine([url], pause_mode="keep", weights_dir=str(tmp_path / "weights"))
    syncs = [BroadcastSync([client], timeout_s=30), DiskSync([client], model_dir=tiny_dir)]

    async def kept_through(sync, seed: int):
        await asyncio.to_thread(call, url, "/pause_generation", {"mode": "in_place"})  # the request stays queued
        task = asyncio.ensure_future(client.agenerate(GenRequest(f"ep{seed}/t0", PROMPT, SamplingParams(4))))
        await asyncio.to_thread(wait_pending, engine, 1)
        version = await sync.push(Trainer(tiny_dir, seed=seed))  # pause in_place, load, resume
        return version, await asyncio.wait_for(task, 60)

    async def run():
        return [await kept_through(sync, seed) for seed, sync in enumerate(syncs, start=3)]

    try:
        pushed = asyncio.run(run())
    finally:
        syncs[0].close()
        asyncio.run(client.aclose())
    for version, response in pushed:
        assert len(response.output_tokens) == 4 and response.output_versions == [version] * 4
    assert [version for version, _ in pushed] == [1, 2] and client.stats["resubmitted"] == 0
