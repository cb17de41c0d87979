"""`SGLangEngine`'s LoRA calls against a real serve-model (SGLang's /load_lora_adapter, /unload_lora_adapter,
/generate's ``lora_path`` and ``sampling_seed``; no real SGLang runs here): tokens and logprobs equal PEFT's,
a replacement under a version mid-generation (SGLang unloads a name before loading it again, so requests in
flight are resubmitted whatever the pause mode), unload, and the bytes a sync moves."""

import asyncio
import shutil
from pathlib import Path

import aiohttp
import pytest
import torch

from areal_agents.config import EngineConfig
from areal_agents.engines.local_servers import engine_client, launch_servers
from areal_agents.engines.remote_lora import adapter_bytes
from areal_agents.errors import RequestError
from areal_agents.models import load_model
from areal_agents.types import GenRequest, SamplingParams
from tests.engines.test_remote_engines import forward_logprobs
from tests.engines.test_vllm_lora import check_versions, greedy, make_adapter

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
N_TOKENS = 200


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sglang_adapters")
    return [(out / f"a{i}", make_adapter(tiny_dir, out / f"a{i}", seed=10 + i)) for i in (1, 2)]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """(config, a serve-model server launched as a run launches it, with LoRA adapters asked for)."""
    cfg = EngineConfig(backend="serve-model", max_lora_rank=16, max_loras=2, device="cpu")
    group = launch_servers(cfg, str(tiny_dir), log_dir=tmp_path_factory.mktemp("serve-lora-logs"), supervise=False)
    yield cfg, group
    group.stop()


async def generated_tokens(url: str) -> int:
    """Tokens serve-model generated since it started (/get_server_info)."""
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/get_server_info") as r:
            return (await r.json())["engine"]["generated_tokens"]


def client(server, **kwargs):
    cfg, group = server
    return engine_client(EngineConfig(**{**cfg.__dict__, **kwargs}), group.addresses)


def test_an_adapters_tokens_and_logprobs_equal_peft_and_a_seed_repeats_a_sample(server, tiny_dir, adapters):
    (path, peft_model), _ = adapters
    ids, engine = PROMPTS[0], client(server)

    async def run():
        try:
            await engine.load_lora_adapter("lora_a", str(path))
            lora = await engine.agenerate(GenRequest("a/t0", ids, SamplingParams(16, temperature=0.0), "lora_a"))
            base = await engine.agenerate(GenRequest("b/t0", ids, SamplingParams(16, temperature=0.0)))
            seeded = [
                await engine.agenerate(GenRequest(f"s{i}/t0", ids, SamplingParams(24, seed=seed), "lora_a"))
                for i, seed in enumerate((3, 3, 4))
            ]
            return lora, base, seeded
        finally:
            await engine.unload_lora_adapter("lora_a")
            await engine.aclose()

    lora, base, (first, again, other) = asyncio.run(run())
    assert lora.output_tokens == greedy(peft_model, ids, 16)
    assert base.output_tokens == greedy(load_model(tiny_dir), ids, 16) != lora.output_tokens
    reference = forward_logprobs(peft_model, ids + lora.output_tokens, len(lora.output_tokens))
    assert torch.allclose(torch.tensor(lora.output_logprobs), reference, atol=1e-4)
    assert first.output_tokens == again.output_tokens != other.output_tokens
    seeded_reference = forward_logprobs(peft_model, ids + first.output_tokens, len(first.output_tokens))
    assert torch.allclose(torch.tensor(first.output_logprobs), seeded_reference, atol=1e-4)


@pytest.mark.parametrize("pause_mode", ["abort", "keep"])
def test_replacing_an_adapter_under_a_version_mid_generation(server, adapters, tmp_path, pause_mode):
    """Adapter 2 replaces adapter 1 (same name) under version 1 while long generations run: every response is
    complete, switches version once, and its logprobs are adapter 1's before and adapter 2's after. A replacement
    pauses with abort whatever ``pause_mode`` says (SGLang unloads a name only once no request uses it): resubmitted."""
    (_, peft_1), (_, peft_2) = adapters
    first, second = tmp_path / "v0", tmp_path / "v1"
    shutil.copytree(adapters[0][0], first)
    shutil.copytree(adapters[1][0], second)
    url, engine, name = server[1].addresses[0], client(server, pause_mode=pause_mode), f"swap_{pause_mode}"

    async def run():
        try:
            await engine.announce_version()
            await engine.load_lora_adapter(name, str(first))
            start = await generated_tokens(url)
            params = SamplingParams(N_TOKENS, ignore_eos=True)
            tasks = [asyncio.ensure_future(engine.agenerate(GenRequest(f"e{i}/t0", p, params, name))) for i, p in
                     enumerate(PROMPTS)]  # fmt: skip
            while await generated_tokens(url) < start + 10 * len(PROMPTS):
                await asyncio.sleep(0.005)
            await engine.load_lora_adapter(name, str(second), version=1)
            shutil.rmtree(first)
            return await asyncio.gather(*tasks)
        finally:
            await engine.unload_lora_adapter(name)
            await engine.aclose()

    responses = asyncio.run(run())
    switches = [check_versions(peft_1, peft_2, p, r, N_TOKENS) for p, r in zip(PROMPTS, responses)]
    assert all(0 < s < N_TOKENS for s in switches), f"the swap lands mid-way in every sequence: {switches}"
    assert engine.stats["resubmitted"] == len(PROMPTS) and engine.get_version() == 1


def test_an_unloaded_adapter_is_refused_and_a_sync_counts_the_adapters_bytes(server, tiny_dir, adapters):
    (path, _), _ = adapters
    engine = client(server, max_retries=1)

    async def run():
        try:
            await engine.load_lora_adapter("gone", str(path))
            await engine.unload_lora_adapter("gone")
            return await engine.agenerate(GenRequest("g/t0", PROMPTS[0], SamplingParams(4), lora_name="gone"))
        finally:
            await engine.aclose()

    with pytest.raises(RequestError, match="HTTP 400: lora_path: LoRA adapter 'gone' is not loaded"):
        asyncio.run(run())
    assert engine.stats["retries"] == 0 and engine.adapters == {}
    assert (
        engine.stats["lora_load_bytes"]
        == adapter_bytes(path)
        < sum(f.stat().st_size for f in Path(tiny_dir).glob("*.safetensors"))
    )

    async def unload_again():
        try:
            await engine.unload_lora_adapter("gone")
        finally:
            await engine.aclose()

    with pytest.raises(RequestError, match="HTTP 400: unload_lora_adapter: LoRA adapter 'gone' is not loaded"):
        asyncio.run(unload_again())


def test_a_server_that_lost_an_adapter_gets_it_again_from_the_client(server, adapters):
    """A server restarted by the launcher's Supervisor serves no adapter loaded at run time; the client, which
    loaded it, loads it there again from its latest directory and sends the request again (here the adapter is
    unloaded behind the client's back, as a restart would lose it)."""
    (path, peft_model), _ = adapters
    url, engine = server[1].addresses[0], client(server)

    async def run():
        try:
            await engine.load_lora_adapter("lost", str(path))
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/unload_lora_adapter", json={"lora_name": "lost"}) as r:
                    assert r.status == 200
            return await engine.agenerate(GenRequest("l/t0", PROMPTS[1], SamplingParams(12, temperature=0.0), "lost"))
        finally:
            await engine.unload_lora_adapter("lost")
            await engine.aclose()

    response = asyncio.run(run())
    assert response.output_tokens == greedy(peft_model, PROMPTS[1], 12) and engine.stats["lora_restored"] == 1
