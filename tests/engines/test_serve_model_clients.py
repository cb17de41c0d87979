"""serve-model holds against its clients (issue 42, item 4), on /generate and the /v1 routes alike: malformed
values are 400s naming the field; ``n`` is capped; a client that disconnects has every branch of its request
aborted; the admin key guards the control routes; a LoRA adapter cannot take the served model's id, its rank
and count are capped, and a refusal never quotes the adapter's files. Body size and /health under load, the
paused /health and the supervisor: ``test_serve_model_limits.py``.

The server here is the real app under uvicorn on a thread of the test process (`serving_app`), so the engine's
counters are in reach; the clients are real HTTP clients.
"""

import http.client
import json
import socket
import time
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

KEY = "the-admin-key"
MAX_N = 1000


def call(url, path, body=None, *, raw=None, key=None, timeout=60.0):
    """(status, JSON reply) of a POST (``raw``: the body's bytes as they are; GET without a body)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            status, text = reply.status, reply.read()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read()
    return status, (json.loads(text) if text.strip() else None)


def message(reply) -> str:
    return reply[1]["error"]["message"]


@pytest.fixture(scope="module")
def served(tiny_dir):
    """(url, the app's `ModelServer`): serve-model with an admin key, ``max_n`` 1000 and small LoRA caps."""
    engine = HFEngine(load_model(tiny_dir), num_threads=1)
    cfg = ModelServerConfig(model_path=str(tiny_dir), max_n=MAX_N, admin_key=KEY, max_lora_rank=8, max_loras=2)
    app = build_app(engine, load_tokenizer(tiny_dir), cfg)
    with serving_app(app) as url:
        yield url, app.state.server


# ---- malformed values: 400 naming the field -------------------------------------------------------

CHAT = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, %s}'
COMPLETION = '{"prompt": "1+1=", "max_tokens": 2, %s}'
GENERATE = '{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, %s}}'
MALFORMED = [
    *((CHAT, "/v1/chat/completions", f'"{k}": {v}', k) for k in ("n", "max_tokens", "seed", "top_k", "top_logprobs")
      for v in ("NaN", "Infinity", "-Infinity")),
    *((COMPLETION, "/v1/completions", f'"{k}": {v}', k) for k in ("n", "max_tokens", "seed", "top_k", "logprobs")
      for v in ("NaN", "Infinity")),
    (CHAT, "/v1/chat/completions", '"top_p": 1e-300', "top_p"),
    (CHAT, "/v1/chat/completions", '"top_k": 100000000000000000000', "top_k"),
    (CHAT, "/v1/chat/completions", '"temperature": Infinity', "temperature"),
    (CHAT, "/v1/chat/completions", '"logprobs": NaN', "logprobs"),
    (COMPLETION, "/v1/completions", '"top_p": 1e-300', "top_p"),
    (COMPLETION, "/v1/completions", '"top_k": 100000000000000000000', "top_k"),
    (COMPLETION, "/v1/completions", '"seed": 100000000000000000000', "seed"),
    *((GENERATE, "/generate", f'"{k}": {v}', f"sampling_params.{k}")
      for k in ("max_new_tokens", "top_k", "sampling_seed", "temperature", "top_p") for v in ("NaN", "Infinity")),
    (GENERATE, "/generate", '"top_p": 1e-300', "sampling_params.top_p"),
    (GENERATE, "/generate", '"top_k": 100000000000000000000', "sampling_params.top_k"),
    (GENERATE, "/generate", '"temperature": 1e-300', "sampling_params.temperature"),
    (GENERATE, "/generate", '"stop_token_ids": [NaN]', "sampling_params.stop_token_ids[0]"),
    (GENERATE, "/generate", '"top_p": 2', "sampling_params.top_p"),
    (GENERATE, "/generate", '"max_new_tokens": -5', "sampling_params.max_new_tokens"),
    (GENERATE, "/generate", '"temperature": -1', "sampling_params.temperature"),
]  # fmt: skip


@pytest.mark.parametrize(("template", "path", "value", "field"), MALFORMED)
def test_malformed_values_are_400s_naming_the_field(served, template, path, value, field):
    url, _ = served
    status, reply = call(url, path, raw=(template % value).encode())
    assert status == 400 and reply["error"]["message"].startswith(f"{field}"), (value, status, reply)
    if path.startswith("/v1"):
        assert reply["error"]["param"] == field.split(".")[0]


@pytest.mark.parametrize(
    ("path", "raw", "field"),
    [
        ("/generate", '{"text": "12\\ud800+3"}', "text"),
        ("/generate", '{"text": ["1", "\\udfff"]}', "text[1]"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages[0].content"),
        ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": "1", "max_tokens": 2, "stop": ["\\udc00"]}', "stop[0]"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(served, path, raw, field):
    url, _ = served
    status, reply = call(url, path, raw=raw.encode())
    assert status == 400 and message((status, reply)).startswith(f"{field}: holds a lone UTF-16 surrogate"), reply
    pair = '{"input_ids": [5], "sampling_params": {"max_new_tokens": 2}, "rid": "\\ud83d\\ude00"}'  # a real emoji
    assert call(url, "/generate", raw=pair.encode())[0] == 200


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/completions"])
def test_deep_nesting_is_400(served, path):
    url, _ = served
    status, reply = call(url, path, raw=b'{"input_ids": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    assert status == 400 and "nests deeper" in message((status, reply))


def test_n_is_capped_at_max_n(served):
    url, _ = served
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    status, reply = call(url, "/v1/chat/completions", {**chat, "n": MAX_N + 1})
    assert status == 400 and reply["error"]["param"] == "n" and f"[1, {MAX_N}]" in message((status, reply))
    status, reply = call(url, "/v1/completions", {"prompt": ["1", "2", "3"], "n": MAX_N // 2, "max_tokens": 1})
    assert status == 400 and "3 prompts x n=500" in message((status, reply)) and "--max-n" in message((status, reply))
    status, reply = call(url, "/generate", {"input_ids": [[5]] * (MAX_N + 1)})
    assert status == 400 and message((status, reply)).startswith(f"input_ids: a batch of {MAX_N + 1} prompts")


# ---- a client that goes away ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "1+1=", "n": MAX_N, "max_tokens": 400, "temperature": 1.0}),
        (
            "/generate",
            {"input_ids": [[5, 6, 7]] * MAX_N, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}},
        ),
    ],
)
def test_a_client_that_disconnects_has_its_1000_branches_aborted(served, path, body):
    url, server = served
    engine = server.engine
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 60
    while engine.num_running < 10:  # its branches are decoding
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    before = engine.stats.generated_tokens
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away without reading the reply
    conn.close()
    deadline = time.monotonic() + 30
    while engine.num_running > 0:
        assert time.monotonic() < deadline, f"{engine.num_running} branches still decoding 30 s after the client left"
        time.sleep(0.01)
    # a decode step or a few (the event loop hears of the disconnect while the decode thread runs): not 400 tokens each
    assert engine.stats.generated_tokens - before < 20_000
    started = time.monotonic()
    status, reply = call(url, "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 3}}, timeout=60)
    assert status == 200 and reply["meta_info"]["completion_tokens"] == 3
    assert time.monotonic() - started < 30  # it waited behind 1,000 branches for 103 s before


# ---- the admin key -----------------------------------------------------------------------------------


def test_control_routes_want_the_admin_key_and_generation_does_not(served):
    url, server = served
    for path, body in [
        ("/pause_generation", {"mode": "in_place"}),
        ("/continue_generation", {}),
        ("/update_weights_from_disk", {"model_path": server.cfg.model_path}),
        ("/update_weight_version", {"new_version": "7"}),
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}),
        ("/unload_lora_adapter", {"lora_name": "x"}),
        ("/init_weights_update_group", {"master_address": "x", "master_port": 1, "rank_offset": 1, "world_size": 2}),
        ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
        ("/destroy_weights_update_group", {}),
    ]:  # fmt: skip
        for key in (None, "wrong"):
            status, reply = call(url, path, body, key=key)
            assert status == 401 and path in message((status, reply)) and "--admin-key" in message((status, reply))
    assert call(url, "/get_weight_version")[1] == {"weight_version": "default"}  # nothing changed
    assert call(url, "/abort_request", {"abort_all": True})[0] == 401
    assert call(url, "/abort_request", {"rid": "mine"})[0] == 200  # one's own request, by its id
    assert call(url, "/abort_request", {"abort_all": True}, key=KEY)[0] == 200
    assert call(url, "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})[0] == 200
    assert call(url, "/pause_generation", {"mode": "in_place"}, key=KEY)[0] == 200
    assert call(url, "/continue_generation", {}, key=KEY)[0] == 200


# ---- LoRA adapters -------------------------------------------------------------------------------------


def adapter(tiny_dir, out, r=4, config=None):
    """A PEFT adapter of rank ``r`` saved to ``out`` (``config``: keys written over its adapter_config.json)."""
    torch.manual_seed(0)
    get_peft_model(
        load_model(tiny_dir), LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear")
    ).save_pretrained(out)
    if config is not None:
        path = out / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return str(out)


def load(url, name, path):
    return call(url, "/load_lora_adapter", {"lora_name": name, "lora_path": path}, key=KEY)


def test_an_adapter_cannot_take_the_served_models_id(served, tiny_dir, tmp_path):
    url, server = served
    status, reply = load(url, str(tiny_dir), adapter(tiny_dir, tmp_path / "shadow"))
    assert status == 400 and reply["success"] is False and "lora_name" in reply["error_message"]
    assert "the served model's id" in reply["error_message"] and str(tiny_dir) not in server.engine.lora_adapters()
    listed = [m["id"] for m in call(url, "/v1/models")[1]["data"]]
    assert listed == [str(tiny_dir)]  # the base model alone answers to its id


def test_adapter_rank_and_count_are_capped(served, tiny_dir, tmp_path):
    url, server = served
    status, reply = load(url, "big", adapter(tiny_dir, tmp_path / "big", r=16))
    assert status == 400 and "r must be an integer rank from 1 to 8 (--max-lora-rank)" in reply["error_message"]
    status, reply = load(
        url, "patterned", adapter(tiny_dir, tmp_path / "pattern", config={"rank_pattern": {"q_proj": 64}})
    )
    assert status == 400 and "rank_pattern entry 0" in reply["error_message"]
    try:
        for name in ("a1", "a2"):
            assert load(url, name, adapter(tiny_dir, tmp_path / name))[0] == 200
        status, reply = load(url, "a3", adapter(tiny_dir, tmp_path / "a3"))
        assert (
            status == 400
            and "2 adapters are loaded" in reply["error_message"]
            and "--max-loras 2" in reply["error_message"]
        )
        assert load(url, "a2", adapter(tiny_dir, tmp_path / "a2b"))[0] == 200  # replacing one is not one more
    finally:
        for name in server.engine.lora_adapters():
            call(url, "/unload_lora_adapter", {"lora_name": name}, key=KEY)


def test_adapter_errors_do_not_quote_its_files(served, tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    url, server = served
    secret = "SECRET-0451"
    bad_type = adapter(tiny_dir, tmp_path / "type", config={"peft_type": secret})  # refused by the engine
    bad_module = adapter(tiny_dir, tmp_path / "module")  # a weight of a module the model does not have
    weights = load_file(tmp_path / "module" / "adapter_model.safetensors")
    first = next(iter(weights))
    weights[first.replace("layers.0", f"layers.0.{secret}")] = weights.pop(first)
    save_file(weights, tmp_path / "module" / "adapter_model.safetensors")
    not_json = adapter(tiny_dir, tmp_path / "json")
    (tmp_path / "json" / "adapter_config.json").write_text(f'{{"r": 4, "{secret}": ')
    try:
        for path in (bad_type, bad_module, not_json):
            status, reply = load(url, "leaky", path)
            assert status == 400 and reply["success"] is False and secret not in json.dumps(reply), reply
            assert "'leaky'" in reply["error_message"]
    finally:
        for name in server.engine.lora_adapters():
            call(url, "/unload_lora_adapter", {"lora_name": name}, key=KEY)
