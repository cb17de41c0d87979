"""serve-model's LoRA API over real HTTP: SGLang's /load_lora_adapter and /unload_lora_adapter (request and
reply shapes), /generate's ``lora_path`` (a name, or one per prompt) and ``sampling_params.sampling_seed``,
and the /v1 routes' ``model`` naming an adapter (vLLM's convention)."""

import json
import urllib.error
import urllib.request

import pytest
import torch
from app_in_thread import serving_app
from peft import LoraConfig, get_peft_model

from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.model_server import ModelServerConfig, build_app
from areal_agents.models import load_model, load_tokenizer

pytestmark = pytest.mark.process

PROMPT = [5, 6, 7, 8]


def peft_adapter(tiny_dir, seed):
    torch.manual_seed(seed)
    pm = get_peft_model(load_model(tiny_dir), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    return pm.eval()


def logprobs(model, ids, n_out):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)[-n_out:]


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    """serve-model's app under uvicorn on a free port in this process; the base URL and two PEFT adapters."""
    adapters = {}
    for i, name in enumerate(("a1", "a2")):
        pm = peft_adapter(tiny_dir, 20 + i)
        path = tmp_path_factory.mktemp(name)
        pm.save_pretrained(path)
        adapters[name] = (str(path), pm)
    engine = HFEngine(load_model(tiny_dir), eos_token_ids=[], num_threads=1)
    app = build_app(engine, load_tokenizer(tiny_dir), ModelServerConfig(model_path=str(tiny_dir)))
    with serving_app(app) as url:
        yield url, adapters


def call(url, path, body=None):
    """(status, JSON reply) of a POST with a JSON body (GET without one)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def generate(url, lora_path, n=6, **sampling):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, **sampling}, "return_logprob": True}
    if lora_path is not None:
        body["lora_path"] = lora_path
    return call(url, "/generate", body)


def test_load_generate_unload_in_sglangs_shapes(served, tiny_dir):
    url, adapters = served
    for name, (path, _) in adapters.items():
        status, reply = call(url, "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert status == 200 and reply["success"] is True and reply["error_message"] == "", reply
    paths = {name: path for name, (path, _) in adapters.items()}
    assert reply["loaded_adapters"] == paths  # SGLang's LoRAUpdateOutput: name -> path
    assert call(url, "/get_weight_version")[1] == {"weight_version": "default"}  # named as before the loads

    body = {"input_ids": [PROMPT] * 3, "lora_path": [None, "a1", "a2"], "return_logprob": True}
    status, replies = call(url, "/generate", {**body, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert status == 200, replies
    base = load_model(tiny_dir).eval()
    for reply, model in zip(replies, (base, adapters["a1"][1], adapters["a2"][1])):
        got = [t[0] for t in reply["meta_info"]["output_token_logprobs"]]
        ref = logprobs(model, PROMPT + reply["output_ids"], 6)
        assert torch.allclose(torch.tensor(got), ref, atol=1e-4)
    lps = [[t[0] for t in r["meta_info"]["output_token_logprobs"]] for r in replies]
    assert lps[0] != lps[1] and lps[1] != lps[2]  # each row served with its own adapter: the checks can fail
    single = generate(url, "a1", temperature=0)[1]  # one name for a single prompt
    assert single["output_ids"] == replies[1]["output_ids"]

    status, reply = call(url, "/unload_lora_adapter", {"lora_name": "a2"})
    assert status == 200 and reply == {"success": True, "error_message": "", "loaded_adapters": {"a1": paths["a1"]}}
    status, reply = call(url, "/unload_lora_adapter", {"lora_name": "a2"})
    assert status == 400 and reply["success"] is False and "'a2' is not loaded (loaded: a1)" in reply["error_message"]
    status, reply = call(url, "/load_lora_adapter", {"lora_name": "a3", "lora_path": "/nonexistent"})
    assert status == 400 and reply["success"] is False and "'a3'" in reply["error_message"]
    assert "no adapter_config.json" in reply["error_message"] and reply["loaded_adapters"] == {"a1": paths["a1"]}


def test_unknown_adapters_are_400s_naming_them(served):
    url, adapters = served
    call(url, "/load_lora_adapter", {"lora_name": "a1", "lora_path": adapters["a1"][0]})
    status, reply = generate(url, "nope")
    assert status == 400 and reply["error"]["message"].startswith("lora_path: LoRA adapter 'nope' is not loaded")
    status, reply = call(url, "/generate", {"input_ids": [PROMPT, PROMPT], "lora_path": ["a1", "a9"]})
    assert status == 400 and reply["error"]["message"].startswith("lora_path[1]: LoRA adapter 'a9' is not loaded")
    status, reply = call(url, "/generate", {"input_ids": [PROMPT, PROMPT], "lora_path": ["a1"]})
    assert status == 400 and "one entry per prompt" in reply["error"]["message"]


def test_sampling_seed_makes_a_sample_reproducible(served):
    url, _ = served
    first = generate(url, None, n=16, sampling_seed=3)[1]["output_ids"]
    assert generate(url, None, n=16, sampling_seed=3)[1]["output_ids"] == first
    assert generate(url, None, n=16, sampling_seed=4)[1]["output_ids"] != first
    status, reply = generate(url, None, sampling_seed="x")
    assert status == 400 and "sampling_seed" in reply["error"]["message"]


def test_openai_routes_serve_an_adapter_named_as_the_model(served, tiny_dir):
    url, adapters = served
    call(url, "/load_lora_adapter", {"lora_name": "a1", "lora_path": adapters["a1"][0]})
    ids = [m["id"] for m in call(url, "/v1/models")[1]["data"]]
    assert ids[0] == str(tiny_dir) and "a1" in ids[1:]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 0}
    with_adapter = call(url, "/v1/completions", {**body, "model": "a1"})[1]
    assert with_adapter["model"] == "a1"
    expected = generate(url, "a1", temperature=0)[1]["meta_info"]["output_token_logprobs"]
    got = with_adapter["choices"][0]["logprobs"]["token_logprobs"]
    assert torch.allclose(torch.tensor(got), torch.tensor([t[0] for t in expected]), atol=1e-5)
    base = call(url, "/v1/completions", {**body, "model": "whatever"})[1]["choices"][0]["logprobs"]["token_logprobs"]
    assert not torch.allclose(torch.tensor(base), torch.tensor(got), atol=1e-3)
    seeded = {"prompt": PROMPT, "max_tokens": 12, "n": 2, "seed": 5}
    texts = [[c["text"] for c in call(url, "/v1/completions", seeded)[1]["choices"]] for _ in range(2)]
    assert texts[0] == texts[1] and texts[0][0] != texts[0][1]  # sample i draws from seed + i
