"""HFEngine serving LoRA adapters: several in one batch (each row as its adapter alone gives it, and as PEFT's
forward gives it), replaced mid-generation, refused when unknown, never sharing cached prefixes."""

import asyncio

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from areal_agents.config import EngineOptions
from areal_agents.engines import HFEngine
from areal_agents.engines.base import LoraEngine
from areal_agents.engines.hf.process_engine import ProcessEngine
from areal_agents.errors import EngineError, RequestError
from areal_agents.models import load_model
from areal_agents.types import GenRequest, SamplingParams

N_TOKENS = 12


def peft_adapter(tiny_dir, seed, rslora=False, targets="all-linear"):
    """A PEFT LoRA over every linear of the tiny model (but the head), lora_B randomised (it starts at zero)."""
    torch.manual_seed(seed)
    config = LoraConfig(r=16, lora_alpha=32, target_modules=targets, use_rslora=rslora)
    pm = get_peft_model(load_model(tiny_dir), config)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02 if not rslora else 0.08)
    return pm.eval()


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    """name -> (PEFT directory, the PEFT model): a1 plain, a2 with rsLoRA scaling."""
    out = {}
    for i, name in enumerate(("a1", "a2")):
        pm = peft_adapter(tiny_dir, seed=10 + i, rslora=i == 1)
        path = tmp_path_factory.mktemp(name)
        pm.save_pretrained(path)
        out[name] = (str(path), pm)
    return out


def logprobs(model, ids, n_out):
    """Logprobs of the last n_out tokens of ids by one full forward of ``model`` (a PEFT model or the base)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)[-n_out:]


def requests():
    """Base, a1 and a2 rows, greedy and sampled (each with its own seed), on two prompts."""
    out = []
    for lora in (None, "a1", "a2"):
        for j, prompt in enumerate(([5, 6, 7, 8], [9, 10, 11])):
            for temperature in (0.0, 1.0):
                sp = SamplingParams(N_TOKENS, temperature=temperature, seed=100 + j if temperature else None)
                out.append(GenRequest(f"{lora}.{j}.{temperature}", prompt, sp, lora_name=lora))
    return out


async def together(engine, reqs):
    await engine.pause()  # admitted in one prefill, decoded in one batch
    tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in reqs]
    await asyncio.sleep(0.02)
    await engine.resume()
    return await asyncio.gather(*tasks)


async def loaded_engine(model, adapters, **kwargs):
    engine = HFEngine(model, eos_token_ids=[], num_threads=1, **kwargs)
    for name, (path, _) in adapters.items():
        await engine.load_lora_adapter(name, path)
    return engine


@pytest.mark.parametrize("fast_decode", [True, False])
def test_mixed_batch_equals_each_adapter_alone_and_peft(model, tiny_dir, adapters, fast_decode):
    reqs = requests()

    async def run():
        engine = await loaded_engine(model, adapters, fast_decode=fast_decode, seed=0)
        assert engine.lora_adapters() == ["a1", "a2"] and isinstance(engine, LoraEngine)
        batched = await together(engine, reqs)
        alone = [await engine.agenerate(r) for r in reqs]
        engine.close()
        return batched, alone

    batched, alone = asyncio.run(run())
    base = load_model(tiny_dir).eval()
    references = {None: base, "a1": adapters["a1"][1], "a2": adapters["a2"][1]}
    for r, b, a in zip(reqs, batched, alone):
        assert b.output_tokens == a.output_tokens, r.rid
        assert torch.allclose(torch.tensor(b.output_logprobs), torch.tensor(a.output_logprobs), atol=1e-4), r.rid
        ref = logprobs(references[r.lora_name], r.input_ids + b.output_tokens, N_TOKENS)
        assert torch.allclose(torch.tensor(b.output_logprobs), ref, atol=1e-4), r.rid
    by_rid = {r.rid: b for r, b in zip(reqs, batched)}
    for lora in ("a1", "a2"):  # the adapters change what is generated: the equalities above can fail
        assert by_rid[f"{lora}.0.1.0"].output_tokens != by_rid["None.0.1.0"].output_tokens
        assert by_rid[f"{lora}.0.0.0"].output_logprobs != by_rid["None.0.0.0"].output_logprobs


@pytest.mark.parametrize("fast_decode", [True, False])
def test_an_adapter_on_the_head_adds_its_delta_to_the_float32_logits(model, tiny_dir, tmp_path, fast_decode):
    """The engine's head runs in float32 without calling the module (nor so its LoRA hook): `head_logits`
    adds the head's delta itself, and the tokens' logprobs are PEFT's."""
    pm = peft_adapter(tiny_dir, seed=12, targets=["lm_head", "q_proj"])
    pm.save_pretrained(tmp_path, save_embedding_layers=False)  # the adapter alone (the head is tied: PEFT adds it)
    prompt = [5, 6, 7, 8]

    async def run():
        engine = HFEngine(model, eos_token_ids=[], num_threads=1, fast_decode=fast_decode, seed=0)
        await engine.load_lora_adapter("head", str(tmp_path))
        sampling = SamplingParams(N_TOKENS, temperature=1.0, seed=3)
        out = await engine.agenerate(GenRequest("r", prompt, sampling, lora_name="head"))
        engine.close()
        return out

    out = asyncio.run(run())
    ref = logprobs(pm, prompt + out.output_tokens, N_TOKENS)
    assert torch.allclose(torch.tensor(out.output_logprobs), ref, atol=1e-4)
    base = logprobs(load_model(tiny_dir), prompt + out.output_tokens, N_TOKENS)
    assert not torch.allclose(base, ref, atol=1e-3)  # the adapter changes them: the equality above can fail


def test_replacing_an_adapter_mid_generation_switches_its_rows(model, tiny_dir, adapters):
    n_tokens = 60
    new = peft_adapter(tiny_dir, seed=33)
    prompts = [[5, 6, 7, 8 + i] for i in range(4)]
    loras = [None, "a1", None, "a1"]
    reqs = [GenRequest(str(i), p, SamplingParams(n_tokens), lora_name=loras[i]) for i, p in enumerate(prompts)]

    async def run():
        engine = await loaded_engine(model, adapters)
        tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in reqs]
        while engine.stats.decode_steps < 15:
            await asyncio.sleep(0.001)
        config = new.peft_config["default"].to_dict()
        await engine.set_lora_adapter("a1", get_peft_model_state_dict(new), config, version=7)
        out = await asyncio.gather(*tasks)
        engine.close()
        return engine, out

    engine, responses = asyncio.run(run())
    assert engine.get_version() == 7 and engine.stats.adapter_updates == 3 and engine.stats.aborted == 0
    base = load_model(tiny_dir).eval()
    for r, resp in zip(reqs, responses):
        v = resp.output_versions
        assert len(resp.output_tokens) == n_tokens and v == sorted(v) and v[0] == 0 and v[-1] == 7
        switch = v.index(7)
        assert 0 < switch < n_tokens
        old, later = (adapters["a1"][1], new) if r.lora_name else (base, base)
        ids = r.input_ids + resp.output_tokens
        after = logprobs(later, ids, n_tokens - switch)
        assert torch.allclose(torch.tensor(resp.output_logprobs[switch:]), after, atol=1e-4)
        before = logprobs(old, ids[: len(ids) - n_tokens + switch], switch)
        assert torch.allclose(torch.tensor(resp.output_logprobs[:switch]), before, atol=1e-4)


def test_unknown_adapters_and_adapters_of_another_model_are_refused(model, adapters):
    weights = get_peft_model_state_dict(adapters["a1"][1])
    config = adapters["a1"][1].peft_config["default"].to_dict()

    async def run():
        engine = await loaded_engine(model, adapters)
        with pytest.raises(RequestError, match=r"lora_name: LoRA adapter 'a3' is not loaded \(loaded: a1, a2\)"):
            await engine.agenerate(GenRequest("x", [5, 6], SamplingParams(2), lora_name="a3"))
        await engine.unload_lora_adapter("a2")
        assert engine.lora_adapters() == ["a1"]
        with pytest.raises(RequestError, match=r"'a2' is not loaded \(loaded: a1\)"):
            await engine.agenerate(GenRequest("x", [5, 6], SamplingParams(2), lora_name="a2"))
        with pytest.raises(RequestError, match="'a_1' is not loaded.*Did you mean 'a1'"):
            await engine.agenerate(GenRequest("x", [5, 6], SamplingParams(2), lora_name="a_1"))
        with pytest.raises(EngineError, match="unload_lora_adapter: LoRA adapter 'a2' is not loaded"):
            await engine.unload_lora_adapter("a2")
        key = next(k for k in weights if k.endswith("layers.1.mlp.up_proj.lora_A.weight"))
        narrow = {**weights, key: weights[key][:, :32]}
        with pytest.raises(EngineError, match=r"'bad'.*'model.layers.1.mlp.up_proj' maps 32 -> 128 features"):
            await engine.set_lora_adapter("bad", narrow, config)
        stray = {**weights, "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": weights[key]}
        with pytest.raises(EngineError, match="'bad': targets 'model.layers.9.mlp.up_proj', which is not"):
            await engine.set_lora_adapter("bad", stray, config)
        with pytest.raises(EngineError, match="use_dora=True is not supported"):
            await engine.set_lora_adapter("bad", weights, {**config, "use_dora": True})
        with pytest.raises(EngineError, match="no adapter_config.json"):
            await engine.load_lora_adapter("bad", "/nonexistent")
        assert engine.lora_adapters() == ["a1"]
        engine.close()

    asyncio.run(run())


def test_the_prefix_cache_never_crosses_adapters(model, tiny_dir, adapters):
    first = GenRequest("t0", [5, 6, 7, 8], SamplingParams(6), lora_name="a1")
    base = load_model(tiny_dir).eval()

    async def next_turn(engine, previous, lora):
        context = previous.input_ids + previous_out[previous.rid] + [9, 10]
        hits = engine.stats.prefix_hit_tokens
        r = GenRequest(f"{lora}.{hits}", context, SamplingParams(4), lora_name=lora)
        resp = await engine.agenerate(r)
        return engine.stats.prefix_hit_tokens - hits, resp, context

    previous_out = {}

    async def run():
        engine = await loaded_engine(model, adapters)
        previous_out["t0"] = (await engine.agenerate(first)).output_tokens
        seen = {}
        for lora in (None, "a2", "a1"):
            seen[lora] = await next_turn(engine, first, lora)
        await engine.load_lora_adapter("a1", adapters["a1"][0])  # replaced (same weights): its entries go
        seen["reloaded"] = await next_turn(engine, first, "a1")
        engine.close()
        return seen

    seen = asyncio.run(run())
    assert seen[None][0] == 0 and seen["a2"][0] == 0  # a1's cached turn is no prefix of theirs
    assert seen["a1"][0] == len(first.input_ids) + 5  # a1's own next turn reuses it (all but its last token)
    assert seen["reloaded"][0] == 0
    for key, model_ in ((None, base), ("a2", adapters["a2"][1]), ("a1", adapters["a1"][1])):
        _, resp, context = seen[key]
        ref = logprobs(model_, context + resp.output_tokens, 4)
        assert torch.allclose(torch.tensor(resp.output_logprobs), ref, atol=1e-4), key


@pytest.mark.process
def test_process_engine_passes_adapters_through(tiny_dir, adapters):
    reqs = [GenRequest("p", [5, 6, 7], SamplingParams(5, temperature=0.0), lora_name="a2")]

    async def run():
        engine = ProcessEngine(str(tiny_dir), options=EngineOptions(cpu_threads=1))
        try:
            await engine.load_lora_adapter("a2", adapters["a2"][0], version=4)
            assert engine.lora_adapters() == ["a2"] and engine.get_version() == 4 and isinstance(engine, LoraEngine)
            resp = await engine.agenerate(reqs[0])
            await engine.unload_lora_adapter("a2")
            with pytest.raises(RequestError, match="'a2' is not loaded"):
                await engine.agenerate(reqs[0])
            return resp
        finally:
            engine.close()

    resp = asyncio.run(run())
    ref = logprobs(adapters["a2"][1], reqs[0].input_ids + resp.output_tokens, 5)
    assert torch.allclose(torch.tensor(resp.output_logprobs), ref, atol=1e-4)


def test_unloading_an_adapter_fails_its_running_requests_alone(model, tiny_dir, adapters):
    reqs = [
        GenRequest(str(i), [5, 6, 7 + i], SamplingParams(40), lora_name=lora) for i, lora in enumerate((None, "a1"))
    ]

    async def run():
        engine = await loaded_engine(model, adapters)
        tasks = [asyncio.ensure_future(engine.agenerate(r)) for r in reqs]
        while engine.stats.decode_steps < 10:
            await asyncio.sleep(0.001)
        await engine.unload_lora_adapter("a1")
        out = await asyncio.gather(*tasks, return_exceptions=True)
        engine.close()
        return out

    base_reply, failure = asyncio.run(run())
    assert isinstance(failure, EngineError) and "LoRA adapter 'a1' was unloaded (loaded: a2)" in str(failure)
    ref = logprobs(load_model(tiny_dir).eval(), reqs[0].input_ids + base_reply.output_tokens, 40)
    assert len(base_reply.output_tokens) == 40
    assert torch.allclose(torch.tensor(base_reply.output_logprobs), ref, atol=1e-4)
