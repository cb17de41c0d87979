"""`ProcessEngine`: the HF engine in a spawned process, as the run uses it (real process, real pipe)."""

import asyncio
import os
import signal

import pytest
import torch
from test_hf_engine import forward_logprobs, perturbed, prompt

from areal_agents.engines import HFEngine, InferenceEngine
from areal_agents.engines.hf.process_engine import ProcessEngine
from areal_agents.errors import EngineError
from areal_agents.types import GenRequest, SamplingParams

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def engine(tiny_dir):
    engine = ProcessEngine(str(tiny_dir), seed=0, device="cpu")  # the device reaches the child's HFEngine
    yield engine
    engine.close()


def test_greedy_matches_the_in_process_engine(engine, model, tokenizer):
    assert isinstance(engine, InferenceEngine)
    requests = [GenRequest(str(i), prompt(tokenizer, f"{i}+{i}="), SamplingParams(8, temperature=0)) for i in range(5)]

    async def run(e):
        return await asyncio.gather(*(e.agenerate(r) for r in requests))

    here = asyncio.run(run(HFEngine(model)))
    there = asyncio.run(run(engine))
    for a, b in zip(here, there):
        assert a.output_tokens == b.output_tokens and a.stop_reason == b.stop_reason
        assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5)
    stats = asyncio.run(engine.get_stats())
    assert stats.requests >= 5 and stats.max_running > 1  # sent together, decoded together
    counters = asyncio.run(engine.counters())  # the child's stats, as floats
    assert counters["requests"] >= 5.0 and counters["generated_tokens"] >= 5.0 and counters["busy_seconds"] > 0


def test_weights_in_shared_memory_switch_the_version_mid_generation(tiny_dir, tokenizer):
    engine = ProcessEngine(str(tiny_dir), seed=0)
    new_weights = perturbed(tiny_dir)
    ids, n = prompt(tokenizer), 120

    async def run():
        engine.set_version(3)
        task = asyncio.ensure_future(
            engine.agenerate(GenRequest("r", ids, SamplingParams(n, ignore_eos=True, stop_token_ids=[])))
        )
        while (await engine.get_stats()).decode_steps < 10:
            await asyncio.sleep(0.001)
        await engine.update_weights(new_weights.state_dict())
        return await task

    try:
        r = asyncio.run(run())
    finally:
        engine.close()
    assert engine.get_version() == 4
    v = r.output_versions
    assert len(v) == n and v[0] == 3 and v[-1] == 4 and v == sorted(v)
    switch = v.index(4)
    after = forward_logprobs(new_weights, ids + r.output_tokens, n - switch)
    assert torch.allclose(torch.tensor(r.output_logprobs[switch:]), after, atol=1e-4)


def test_pause_holds_requests_and_cancel_frees_them(engine, tokenizer):
    async def run():
        await engine.pause()
        held = asyncio.ensure_future(engine.agenerate(GenRequest("held", prompt(tokenizer), SamplingParams(4))))
        gone = asyncio.ensure_future(engine.agenerate(GenRequest("gone", prompt(tokenizer), SamplingParams(4))))
        await asyncio.sleep(0.1)
        assert not held.done() and not gone.done()
        gone.cancel()
        await engine.resume()
        return await held

    assert 1 <= len(asyncio.run(run()).output_tokens) <= 4


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    """The tiny model with 8192 positions: a request that is still running when its process is killed
    (the engine caps a request at the model's context, 512 for the default tiny model)."""
    from areal_agents.models.tiny import save_tiny_model

    out = tmp_path_factory.mktemp("tiny_long")
    return save_tiny_model(out, hidden_size=64, num_layers=2, intermediate_size=128, max_position_embeddings=8192)


def test_a_dead_engine_process_fails_its_requests_clearly(long_dir, tokenizer):
    engine = ProcessEngine(str(long_dir))

    async def run():
        task = asyncio.ensure_future(
            engine.agenerate(GenRequest("r", prompt(tokenizer), SamplingParams(100000, ignore_eos=True)))
        )
        await asyncio.sleep(0.2)
        os.kill(engine._process.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="engine process is gone"):
            await task
        with pytest.raises(EngineError, match="engine process is gone"):
            await engine.agenerate(GenRequest("again", prompt(tokenizer), SamplingParams(4)))

    try:
        asyncio.run(run())
    finally:
        engine.close()
    assert not engine._process.is_alive()


def test_a_model_that_does_not_load_is_an_error_naming_it(tmp_path):
    with pytest.raises(EngineError, match="could not start an engine for .*nowhere"):
        ProcessEngine(str(tmp_path / "nowhere"))


def test_a_refused_request_stays_a_request_error_across_the_pipe(engine):
    """The episode runner never retries a `RequestError`; the process engine must not turn it into a plain
    `EngineError` (which it would retry)."""
    from areal_agents.errors import RequestError

    request = GenRequest("bad", [10**6], SamplingParams(max_new_tokens=2, temperature=0.0))
    with pytest.raises(RequestError, match="vocab"):
        asyncio.run(engine.agenerate(request))
