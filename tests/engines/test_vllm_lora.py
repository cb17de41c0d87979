"""LoRA adapters on a real vLLM server through `VLLMEngine`: the runtime ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` routes, requests naming their adapter, replacement under a version (abort and keep),
and what a sync moves. The references are PEFT's own forward and generate on the same adapter directories.

One vLLM server (``--enable-lora``, its CPU build: punica_cpu) for the whole file, on the tiny model with head_dim
32 that `test_remote_engines` uses. vLLM comes from ``.venv-vllm`` (``bash scripts/setup.sh --with-vllm``) or
``$AREAL_VLLM_PYTHON``; without one these skip here and fail under CI=true.
"""

import asyncio
import re
import shutil
from pathlib import Path

import aiohttp
import pytest
import torch

from areal_agents.config import EngineConfig
from areal_agents.engines.local_servers import engine_client, launch_servers
from areal_agents.engines.remote_lora import adapter_bytes
from areal_agents.errors import EngineError, RequestError
from areal_agents.models import load_model, load_tokenizer
from areal_agents.types import GenRequest, SamplingParams
from tests.engines.test_remote_engines import VLLM_PYTHON, forward_logprobs, prompt

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
N_TOKENS = 900  # long enough that a swap lands mid-way (vLLM decodes the tiny model fast)
ATTEMPTS = 3
STD = 0.4  # lora_B's random init: an adapter that changes the tiny model's greedy tokens


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from areal_agents.models.tiny import save_tiny_model

    out = tmp_path_factory.mktemp("tiny_lora")
    return save_tiny_model(out, hidden_size=128, num_layers=2, intermediate_size=256, max_position_embeddings=1024)


def make_adapter(tiny_dir: Path, out: Path, seed: int, std: float = STD):
    """A PEFT adapter (r 16, alpha 32, every linear layer) with random lora_B (PEFT starts it at zero, which
    would make the adapter a no-op), saved to ``out``; the PEFT model is the reference."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(load_model(tiny_dir), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=std)
    peft_model.save_pretrained(out)
    return peft_model.eval()


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    """Two adapters of the tiny model: (directory, PEFT model) each."""
    out = tmp_path_factory.mktemp("adapters")
    return [(out / f"a{i}", make_adapter(tiny_dir, out / f"a{i}", seed=i)) for i in (1, 2)]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """(config, a vLLM server taking adapters up to rank 16, two in a batch)."""
    if not Path(VLLM_PYTHON).is_file():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: bash scripts/setup.sh --with-vllm")
    cfg = EngineConfig(
        backend="vllm", vllm_python=VLLM_PYTHON, extra_args=["--enforce-eager"], max_lora_rank=16, max_loras=2
    )
    group = launch_servers(cfg, str(tiny_dir), log_dir=tmp_path_factory.mktemp("vllm-lora-logs"), supervise=False)
    yield cfg, group
    group.stop()


def client(server, **kwargs):
    cfg, group = server
    return engine_client(EngineConfig(**{**cfg.__dict__, **kwargs}), group.addresses)


def greedy(model, ids, n=24):
    with torch.no_grad():
        return model.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()


def test_an_adapters_tokens_and_logprobs_equal_peft_and_base_requests_the_base_model(server, tiny_dir, adapters):
    """Greedy tokens equal PEFT's generate; greedy and sampled logprobs equal PEFT's forward (atol 1e-4; measured
    ~5e-7 on vLLM's CPU build in float32). Requests naming no adapter get the base model's, which differ."""
    (path, peft_model), _ = adapters
    base_model, ids = load_model(tiny_dir), prompt(load_tokenizer(tiny_dir))
    engine = client(server)

    async def run():
        try:
            await engine.load_lora_adapter("lora_a", str(path))
            lora = await engine.agenerate(GenRequest("a/t0", ids, SamplingParams(24, temperature=0.0), "lora_a"))
            sampled = await engine.agenerate(GenRequest("b/t0", ids, SamplingParams(24, temperature=0.7), "lora_a"))
            base = await engine.agenerate(GenRequest("c/t0", ids, SamplingParams(24, temperature=0.0)))
            return lora, sampled, base
        finally:
            await engine.aclose()

    lora, sampled, base = asyncio.run(run())
    assert lora.output_tokens == greedy(peft_model, ids)
    assert base.output_tokens == greedy(base_model, ids) != lora.output_tokens, "the adapter changes the model"
    for response, temperature in ((lora, 1.0), (sampled, 0.7)):
        out = response.output_tokens
        reference = forward_logprobs(peft_model, ids + out, len(out), temperature)
        assert torch.allclose(torch.tensor(response.output_logprobs), reference, atol=1e-4)
    base_lp = forward_logprobs(base_model, ids + lora.output_tokens, len(lora.output_tokens))
    assert not torch.allclose(torch.tensor(lora.output_logprobs), base_lp, atol=1e-2)
    assert engine.get_version() == 0 and engine.adapters == {"lora_a": str(path)}


def test_a_requests_seed_makes_its_sample_repeatable(server, tiny_dir, adapters):
    (path, _), _ = adapters
    ids = prompt(load_tokenizer(tiny_dir))
    engine = client(server)

    async def run():
        try:
            await engine.load_lora_adapter("seeded", str(path))
            return [
                (await engine.agenerate(GenRequest(f"s{i}/t0", ids, SamplingParams(32, seed=seed), "seeded")))
                for i, seed in enumerate((7, 7, 8))
            ]
        finally:
            await engine.aclose()

    first, again, other = asyncio.run(run())
    assert first.output_tokens == again.output_tokens != other.output_tokens


@pytest.mark.parametrize("pause_mode", ["abort", "keep"])
def test_replacing_an_adapter_under_a_version_mid_generation(server, tiny_dir, adapters, tmp_path, pause_mode):
    """Long generations with adapter 1 in flight; adapter 2 replaces it (same name) under version 1. Each response
    is complete, its versions switch once, its logprobs are adapter 1's before the switch and adapter 2's after.
    A replacement pauses with abort whatever ``pause_mode`` says (`RemoteLora.lora_pause_mode`): each sequence is
    resubmitted. Adapter 1's directory is deleted after the swap: nothing reads it again (vLLM re-reads an
    adapter loaded with ``load_inplace`` at every step, and died when its directory was gone).
    Later requests get adapter 2's greedy tokens, tagged 1. Where the
    swap lands depends on the cores' load (vLLM decodes the tiny model fast), so a try where some sequence did
    not switch mid-way is run again, up to ``ATTEMPTS`` times, as in test_remote_engines."""
    (_, peft_1), (_, peft_2) = adapters
    tokenizer, url = load_tokenizer(tiny_dir), server[1].addresses[0]
    prompts = [prompt(tokenizer, f"{i}+{i}=") for i in range(4)]
    name = f"swap_{pause_mode}"

    async def run(engine, first, second):
        try:
            engine.set_version(0)
            await engine.announce_version()
            await engine.load_lora_adapter(name, str(first))
            start = await first_tokens(url)
            params = SamplingParams(N_TOKENS, ignore_eos=True)
            tasks = [asyncio.ensure_future(engine.agenerate(GenRequest(f"e{i}/t0", p, params, name))) for i, p in
                     enumerate(prompts)]  # fmt: skip
            while await first_tokens(url) < start + len(prompts):  # every sequence under way
                await asyncio.sleep(0.01)
            await engine.load_lora_adapter(name, str(second), version=1)
            shutil.rmtree(first)
            responses = await asyncio.gather(*tasks)
            after = await engine.agenerate(
                GenRequest("after/t0", prompts[0], SamplingParams(24, temperature=0.0), name)
            )
            return responses, after
        finally:
            await engine.unload_lora_adapter(name)
            await engine.aclose()

    for attempt in range(ATTEMPTS):
        first, second = tmp_path / f"{attempt}" / "v0", tmp_path / f"{attempt}" / "v1"
        shutil.copytree(adapters[0][0], first)
        shutil.copytree(adapters[1][0], second)
        engine = client(server, pause_mode=pause_mode)
        responses, after = asyncio.run(run(engine, first, second))
        assert after.output_tokens == greedy(peft_2, prompts[0]) and set(after.output_versions) == {1}
        assert engine.get_version() == 1 and engine.stats["lora_loads"] == 2
        switches = [check_versions(peft_1, peft_2, p, r, N_TOKENS) for p, r in zip(prompts, responses)]
        if all(0 < s < N_TOKENS for s in switches):
            assert engine.stats["resubmitted"] == len(prompts), "each sequence resubmitted once"
            return
    pytest.fail(f"the swap never landed mid-way in every sequence in {ATTEMPTS} tries (the last: {switches})")


def check_versions(old, new, prompt_ids: list[int], response, n_tokens: int) -> int:
    """One response of a swap: complete, versions 0 then 1 (switching at most once), each token's logprob that of
    the adapter its version names. Returns the index of the first version-1 token (``n_tokens`` when none is)."""
    out, v = response.output_tokens, response.output_versions
    assert len(out) == n_tokens and response.stop_reason == "length"
    assert v == sorted(v) and set(v) <= {0, 1}, f"versions switch at most once, from 0 to 1: {v}"
    before = forward_logprobs(old, prompt_ids + out, n_tokens)
    after = forward_logprobs(new, prompt_ids + out, n_tokens)
    expected = torch.where(torch.tensor(v) == 0, before, after)
    assert torch.allclose(torch.tensor(response.output_logprobs), expected, atol=1e-4), "logprobs match versions"
    return v.index(1) if 1 in v else n_tokens


async def first_tokens(url: str) -> int:
    """Requests that got their first token since the vLLM server started (/metrics)."""
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    pattern = r"^vllm:time_to_first_token_seconds_count\{[^}]*\} (\S+)$"
    return int(sum(float(v) for v in re.findall(pattern, text, re.M)))


def test_an_unloaded_adapter_is_refused_and_a_directory_that_is_none_is_refused_before_a_server_sees_it(
    server, tiny_dir, adapters, tmp_path
):
    (path, _), _ = adapters
    engine = client(server, max_retries=1)
    (tmp_path / "empty").mkdir()

    async def run(request):
        try:
            return await engine.agenerate(request)
        finally:
            await engine.aclose()

    async def load_then_unload():
        try:
            await engine.load_lora_adapter("gone", str(path))
            await engine.unload_lora_adapter("gone")
        finally:
            await engine.aclose()

    asyncio.run(load_then_unload())
    assert "gone" not in engine.adapters
    with pytest.raises(RequestError, match="HTTP 404: The model `gone` does not exist"):
        asyncio.run(run(GenRequest("g/t0", [5, 6, 7], SamplingParams(4), lora_name="gone")))
    with pytest.raises(EngineError, match="no adapter_config.json"):
        asyncio.run(engine.load_lora_adapter("empty", str(tmp_path / "empty")))
    assert engine.stats["retries"] == 0
    after = asyncio.run(run(GenRequest("base/t0", [5, 6, 7], SamplingParams(4))))
    assert len(after.output_tokens) == 4, "the server goes on serving"


def test_a_sync_moves_the_adapters_bytes_not_the_models(server, tiny_dir, adapters):
    """What a sync moves: the adapter file, r x (in + out) floats per adapted linear layer. On the tiny model
    (hidden 128, r 16) that is under a fifth of the weights; on a 7B model at r 16 under 1%."""
    (path, peft_model), _ = adapters
    engine = client(server)

    async def run():
        try:
            await engine.load_lora_adapter("measured", str(path))
        finally:
            await engine.unload_lora_adapter("measured")
            await engine.aclose()

    asyncio.run(run())
    lora_floats = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    model_bytes = sum(f.stat().st_size for f in Path(tiny_dir).glob("*.safetensors"))
    moved = engine.stats["lora_load_bytes"]
    assert moved == adapter_bytes(path) and 0 <= moved - 4 * lora_floats < 16_384, "float32 tensors + header"
    assert moved < model_bytes / 4
    assert engine.stats["lora_load_seconds"] > 0


def test_a_server_that_lost_an_adapter_gets_it_again_from_the_client(server, tiny_dir, adapters):
    """A vLLM server restarted by the launcher's Supervisor serves no adapter loaded at run time (a 404 naming the
    model); the client, which loaded it, loads it there again from its latest directory and sends the request
    again. Here it is unloaded behind the client's back, as a restart would lose it."""
    _, (path, peft_model) = adapters
    ids, url, engine = prompt(load_tokenizer(tiny_dir)), server[1].addresses[0], client(server)

    async def run():
        try:
            await engine.load_lora_adapter("lost", str(path))
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/unload_lora_adapter", json={"lora_name": "lost"}) as r:
                    assert r.status == 200
            return await engine.agenerate(GenRequest("l/t0", ids, SamplingParams(24, temperature=0.0), "lost"))
        finally:
            await engine.unload_lora_adapter("lost")
            await engine.aclose()

    response = asyncio.run(run())
    assert response.output_tokens == greedy(peft_model, ids) and engine.stats["lora_restored"] == 1
