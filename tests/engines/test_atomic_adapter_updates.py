"""LoRA adapter loads are all or nothing (issue 42, item 3): a refused load or replacement of an adapter (a
NaN, a wrong shape, a module the model lacks, an unreadable file) leaves the adapter of that name serving
bit-identical logprobs, the engine's version and `LoraSync`'s versions as they were, and says what was wrong
without quoting the file; through the engine, `LoraSync` and serve-model's /load_lora_adapter."""

import asyncio
import json
import shutil
import urllib.error
import urllib.request

import pytest
import torch
from app_in_thread import serving_app
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.lora_sync import LoraGroup
from areal_agents.engines.model_server import ModelServerConfig, build_app
from areal_agents.errors import EngineError
from areal_agents.models import load_model, load_tokenizer
from areal_agents.types import GenRequest, SamplingParams

PROMPT = [5, 6, 7, 8]
SECRET = "hunter2-do-not-echo"
Q_B = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"


def peft_model(tiny_dir, seed):
    """A PEFT LoRA over every linear of the tiny model, lora_B randomised (it starts at zero)."""
    torch.manual_seed(seed)
    pm = get_peft_model(load_model(tiny_dir), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    return pm.eval()


@pytest.fixture(scope="module")
def adapter_dirs(tiny_dir, tmp_path_factory):
    """Two good PEFT adapter directories of other weights: "served" and "next"."""
    out = {}
    for i, name in enumerate(("served", "next")):
        path = tmp_path_factory.mktemp(name)
        peft_model(tiny_dir, seed=30 + i).save_pretrained(path)
        out[name] = path
    return out


def rewritten(good, path, change):
    """A copy of the adapter directory ``good`` at ``path`` whose tensors ``change(dict)`` edits in place."""
    shutil.copytree(good, path, dirs_exist_ok=True)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


def nan(tensors):
    tensors[Q_B] = tensors[Q_B].clone()
    tensors[Q_B][0, 0] = float("nan")


def wrong_rank(tensors):
    tensors[Q_B] = tensors[Q_B][:, :-1].contiguous()


def unknown_module(tensors):
    tensors["base_model.model.model.layers.1.self_attn.z_proj.lora_A.weight"] = torch.zeros(8, 64)


def int_dtype(tensors):
    tensors[Q_B] = torch.ones(tensors[Q_B].shape, dtype=torch.int32)


def truncated(good, path):
    shutil.copytree(good, path, dirs_exist_ok=True)
    data = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(data[:-100])


def secret_header(good, path):
    shutil.copytree(good, path, dirs_exist_ok=True)
    header = json.dumps({SECRET: SECRET}).encode()
    (path / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)


def secret_config(good, path):
    shutil.copytree(good, path, dirs_exist_ok=True)
    (path / "adapter_config.json").write_text(f'{{"lora_alpha": 16, {SECRET}')


BAD_ADAPTERS = {
    "NaN": (lambda g, p: rewritten(g, p, nan), "'model.layers.1.self_attn.q_proj' lora_B has NaN or infinite values"),
    "wrong rank": (lambda g, p: rewritten(g, p, wrong_rank), "are not [r, in] and [out, r]"),
    "unknown module": (lambda g, p: rewritten(g, p, unknown_module), "which is not a linear layer of the served model"),
    "int dtype": (lambda g, p: rewritten(g, p, int_dtype), "expects floating point"),
    "truncated": (truncated, "not a readable safetensors file"),
    "corrupt header": (secret_header, "not a readable safetensors file"),
    "bad config": (secret_config, "adapter_config.json: not valid JSON (line 1, column"),
}


async def with_adapter(engine, name="a1") -> tuple[list[int], list[float], int]:
    r = await engine.agenerate(GenRequest("g", PROMPT, SamplingParams(8, temperature=0), lora_name=name))
    return r.output_tokens, r.output_logprobs, engine.get_version()


def test_a_refused_adapter_leaves_the_one_of_its_name_and_the_version_as_they_were(tiny_dir, adapter_dirs, tmp_path):
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=[], num_threads=1)

    async def run():
        await engine.load_lora_adapter("a1", str(adapter_dirs["served"]), version=3)
        before = await with_adapter(engine)
        for case, (write, said) in BAD_ADAPTERS.items():
            path = tmp_path / case.replace(" ", "_")
            write(adapter_dirs["next"], path)
            with pytest.raises(Exception) as refused:
                await engine.load_lora_adapter("a1", str(path), version=4)
            assert await with_adapter(engine) == before, f"{case}: the refused adapter changed what a1 serves"
            assert isinstance(refused.value, EngineError), case
            assert said in str(refused.value) and SECRET not in str(refused.value), (case, str(refused.value))
            assert engine.lora_adapters() == ["a1"]
        await engine.load_lora_adapter("a1", str(adapter_dirs["next"]), version=4)  # whole: it replaces a1
        return before, await with_adapter(engine)

    try:
        before, after = asyncio.run(run())
    finally:
        engine.close()
    assert after[2] == 4 and after[1] != before[1]


class AdapterSource:
    """A LoRA policy's weights as `LoraSync` takes them: its adapter's tensors and config."""

    def __init__(self, pm, nan_at: str | None = None) -> None:
        self.tensors_ = {k: v.clone() for k, v in get_peft_model_state_dict(pm).items()}
        if nan_at is not None:
            self.tensors_[nan_at][0, 0] = float("inf")
        self.config = pm.peft_config["default"].to_dict()

    async def tensors(self):
        return self.tensors_

    async def save_weights(self, path, dtype=None):
        raise AssertionError("an engine in this process takes the tensors")

    def adapter_config(self):
        return self.config


def test_a_refused_lora_sync_push_keeps_every_version(tiny_dir):
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=[], num_threads=1)
    group = LoraGroup(engine)
    view, sync = group.view("a1"), group.sync("a1")
    first, second = peft_model(tiny_dir, seed=40), peft_model(tiny_dir, seed=41)

    async def run():
        assert await sync.push(AdapterSource(first)) == 1
        before = await with_adapter(view, None)
        with pytest.raises(EngineError, match="'model.layers.1.self_attn.q_proj' lora_B has NaN or infinite"):
            await sync.push(AdapterSource(second, nan_at=Q_B))
        assert group.versions == {"a1": 1} and await with_adapter(view, None) == before
        assert await sync.push(AdapterSource(second)) == 2, "the next push is the policy's version 2, not 3"
        return before, await with_adapter(view, None)

    try:
        before, after = asyncio.run(run())
    finally:
        engine.close()
    assert after[2] == 2 and after[1] != before[1]


def call(url, path, body):
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def served(url, body) -> tuple[list, str]:
    """The (logprob, token) pairs and weight_version of a /generate (JSON floats round-trip exactly)."""
    status, reply = call(url, "/generate", body)
    assert status == 200, reply
    return [t[:2] for t in reply["meta_info"]["output_token_logprobs"]], reply["meta_info"]["weight_version"]


@pytest.mark.slow
def test_serve_model_keeps_the_adapter_a_refused_load_would_replace(tiny_dir, adapter_dirs, tmp_path):
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=[], num_threads=1)
    app = build_app(engine, load_tokenizer(tiny_dir), ModelServerConfig(model_path=str(tiny_dir)))
    generate = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    generate |= {"return_logprob": True, "lora_path": "a1"}
    with serving_app(app) as url:
        status, reply = call(url, "/load_lora_adapter", {"lora_name": "a1", "lora_path": str(adapter_dirs["served"])})
        assert status == 200, reply
        before = served(url, generate)
        rewritten(adapter_dirs["next"], tmp_path, nan)
        status, reply = call(url, "/load_lora_adapter", {"lora_name": "a1", "lora_path": str(tmp_path)})
        assert status == 400 and reply["success"] is False
        assert served(url, generate) == before
        assert "Failed to load LoRA adapter 'a1'" in reply["error_message"]  # the reason: the engine's, above
        assert reply["loaded_adapters"] == {"a1": str(adapter_dirs["served"])}
    engine.close()
