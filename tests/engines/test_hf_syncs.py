"""A decode step of `HFEngine` reads the device on the host once: the sampled tokens, their logprobs, which
rows could be sampled and the step's KV counter together (on CUDA each read waits for the GPU). Which
filters run (top-k, top-p) is decided from the requests on the host. Counted on the CPU (`tests.host_syncs`)."""

import asyncio

import pytest

from areal_agents.engines import HFEngine
from areal_agents.engines.hf.batch_runner import BatchRunner
from areal_agents.types import GenRequest, SamplingParams
from tests.host_syncs import count_host_syncs


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=1.0),
        dict(temperature=1.0, top_p=0.9, top_k=5),
        dict(temperature=0.0),
    ],
)
def test_a_decode_step_reads_the_device_once(model, monkeypatch, sampling):
    counts = []
    decode = BatchRunner.decode

    def counted(self, batch, version):
        with count_host_syncs() as syncs:
            decode(self, batch, version)
        counts.append((len(batch.rows), syncs.total, dict(syncs.calls)))

    monkeypatch.setattr(BatchRunner, "decode", counted)
    engine = HFEngine(model, seed=0)

    async def run():
        requests = [GenRequest(f"r{i}", [1, 5 + i, 9], SamplingParams(8, **sampling)) for i in range(3)]
        return await asyncio.gather(*(engine.agenerate(r) for r in requests))

    responses = asyncio.run(run())
    assert all(len(r.output_tokens) >= 1 for r in responses)
    assert len(counts) >= 3 and max(rows for rows, *_ in counts) == 3
    for rows, total, calls in counts:
        assert total <= 1, f"{rows} rows: {calls}"
