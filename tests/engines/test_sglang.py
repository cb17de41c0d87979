"""The SGLang client against `serve-model` (a real HTTP server over a real model), and the JSON shapes."""

import asyncio
import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch

from areal_agents.config import EngineConfig, EngineOptions
from areal_agents.engines.local_servers import ServerGroup, launch_servers, server_command, wait_healthy
from areal_agents.engines.sglang.client import SGLangEngine
from areal_agents.engines.sglang.protocol import read_generate_response
from areal_agents.errors import EngineError
from areal_agents.net import free_port
from areal_agents.types import GenRequest, SamplingParams

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "sglang_0.5.json").read_text())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny model with room for the long generations below (8192 positions: serve-model caps a request
    at the model's context, 512 for the default tiny model)."""
    from areal_agents.models.tiny import save_tiny_model

    out = tmp_path_factory.mktemp("tiny_long")
    return save_tiny_model(out, hidden_size=64, num_layers=2, intermediate_size=128, max_position_embeddings=8192)


def prompt(tokenizer, text="12+34="):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )


def forward_logprobs(model, ids, n_out):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return logp[-n_out:]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    group = launch_servers(EngineConfig(backend="serve-model"), str(tiny_dir), log_dir=tmp_path_factory.mktemp("logs"))
    yield group
    group.stop()


async def post(url, path, body=None):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body) as r:
            text = await r.text()
            return r.status, (json.loads(text) if text.strip().startswith(("{", "[")) else text)


async def get(url, path):
    async with aiohttp.ClientSession() as s:
        async with s.get(url + path) as r:
            return r.status, await r.json(content_type=None)


def same_shape(ours, theirs, path="") -> list[str]:
    """Keys (recursively) of SGLang's reply that ours lacks, or whose JSON types differ."""
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [f"{path}: not an object"]
        return [
            p
            for k, v in theirs.items()
            for p in ([f"{path}.{k} missing"] if k not in ours else same_shape(ours[k], v, f"{path}.{k}"))
        ]
    if isinstance(theirs, list) and theirs and isinstance(ours, list) and ours:
        return same_shape(ours[0], theirs[0], f"{path}[0]")
    kinds = (bool, (int, float), str, list, type(None))
    for kind in kinds:
        if isinstance(theirs, kind):
            return (
                [] if isinstance(ours, kind) or theirs is None or ours is None else [f"{path}: {type(ours).__name__}"]
            )
    return []


# ---- the recorded SGLang 0.5.x shapes ------------------------------------------------------------


def test_client_reads_every_recorded_sglang_reply():
    stop = read_generate_response(FIXTURE["generate_stop"])
    assert stop.tokens == [9707, 1879, 151645] and stop.finish == "stop" and stop.versions == ["default"] * 3
    assert stop.logprobs == [-0.12, -1.3, -0.01]
    length = read_generate_response(FIXTURE["generate_length_0.5.4_output_ids_with_prompt_prefix"])
    assert length.tokens == [14, 15]  # from the logprob triples: 0.5.1-0.5.4 prefix output_ids with prompt ids
    aborted = read_generate_response(FIXTURE["generate_abort_running"])
    assert aborted.finish == "abort" and aborted.tokens == [501, 502] and aborted.message == "Aborted"
    early = read_generate_response(FIXTURE["generate_abort_before_prefill_0.5.4"])
    assert early.finish == "abort" and early.tokens == [] and early.versions == []
    spans = read_generate_response(FIXTURE["generate_weight_versions_0.5.23"])
    assert spans.versions == ["7", "7", "8"]


@pytest.mark.process
def test_serve_model_replies_have_sglang_shapes(server, tokenizer):
    url = server.addresses[0]

    async def run():
        body = {"input_ids": prompt(tokenizer), "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
        replies = {"generate_stop": (await post(url, "/generate", body))[1]}
        replies["get_model_info"] = (await get(url, "/get_model_info"))[1]
        replies["get_weight_version"] = (await get(url, "/get_weight_version"))[1]
        replies["pause_generation"] = (await post(url, "/pause_generation", {"mode": "abort"}))[1]
        replies["continue_generation"] = (await post(url, "/continue_generation", {}))[1]
        replies["error_400"] = (await post(url, "/generate", {**body, "sampling_params": {"top_q": 1}}))[1]
        return replies

    replies = asyncio.run(run())
    for name, ours in replies.items():
        theirs = FIXTURE[name]
        if name == "generate_stop":
            theirs = {
                **theirs,
                "meta_info": {**theirs["meta_info"], "finish_reason": ours["meta_info"]["finish_reason"]},
            }
        assert same_shape(ours, theirs) == [], name
    assert "top_q" in replies["error_400"]["error"]["message"]


# ---- serve-model over HTTP -------------------------------------------------------------------


@pytest.mark.process
def test_generate_logprobs_match_a_forward_pass(server, tokenizer, model):
    ids = prompt(tokenizer)
    engine = SGLangEngine(server.addresses)

    async def run():
        try:
            return await engine.agenerate(GenRequest("ep/t0", ids, SamplingParams(12, temperature=1.0)))
        finally:
            await engine.aclose()

    r = asyncio.run(run())
    assert len(r.output_tokens) >= 1 and r.output_versions == [0] * len(r.output_tokens)
    ref = forward_logprobs(model, ids + r.output_tokens, len(r.output_tokens))
    assert torch.allclose(torch.tensor(r.output_logprobs), ref, atol=1e-4)


@pytest.mark.process
def test_bad_requests_are_400_and_fail_at_once(server, tokenizer):
    url = server.addresses[0]
    ids = prompt(tokenizer)

    async def run():
        unknown = await post(url, "/generate", {"input_ids": ids, "sampling_params": {"temprature": 0.5}})
        unsupported = await post(url, "/generate", {"input_ids": ids, "sampling_params": {"n": 2}})
        no_input = await post(url, "/generate", {"sampling_params": {}})
        engine = SGLangEngine(server.addresses, max_retries=3)
        with pytest.raises(EngineError, match="HTTP 400: input_ids must be a non-empty list"):
            await engine.agenerate(GenRequest("x/t0", [], SamplingParams(4)))  # a 4xx is not retried
        await engine.aclose()
        return unknown, unsupported, no_input, engine.stats["retries"]

    unknown, unsupported, no_input, retries = asyncio.run(run())
    assert unknown[0] == 400 and "sampling_params.temprature" in unknown[1]["error"]["message"]
    assert unsupported[0] == 400 and "n=2" in unsupported[1]["error"]["message"]
    assert no_input[0] == 400 and "input_ids" in no_input[1]["error"]["message"]
    assert retries == 0


@pytest.mark.process
def test_abort_request_returns_partial_tokens(server, tokenizer):
    url = server.addresses[0]
    body = {
        "input_ids": prompt(tokenizer),
        "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True},
        "return_logprob": True,
        "rid": "long-one",
    }

    async def run():
        task = asyncio.ensure_future(post(url, "/generate", body))
        await asyncio.sleep(0.5)
        assert (await post(url, "/abort_request", {"rid": "long-one"}))[0] == 200
        return await task

    status, reply = asyncio.run(run())
    part = read_generate_response(reply)
    assert status == 200 and part.finish == "abort" and 0 < len(part.tokens) < 5000


@pytest.mark.process
def test_pause_aborts_in_flight_and_holds_new_requests_until_continue(server, tokenizer):
    url = server.addresses[0]
    body = {
        "input_ids": prompt(tokenizer),
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        "return_logprob": True,
    }

    async def run():
        running = asyncio.ensure_future(post(url, "/generate", body))
        await asyncio.sleep(0.3)
        await post(url, "/pause_generation", {"mode": "abort"})
        aborted = await running
        held = asyncio.ensure_future(post(url, "/generate", {**body, "sampling_params": {"max_new_tokens": 3}}))
        await asyncio.sleep(0.3)
        was_held = not held.done()
        await post(url, "/continue_generation", {})
        return aborted, was_held, await held

    aborted, was_held, held = asyncio.run(run())
    assert aborted[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert was_held and held[1]["meta_info"]["completion_tokens"] == 3


def test_episode_stickiness_and_round_robin():
    engine = SGLangEngine(["http://a:1", "http://b:2", "http://c:3"])
    first = [engine._server_for(f"ep{i}/t0") for i in range(6)]
    assert first == [0, 1, 2, 0, 1, 2]
    assert [engine._server_for(f"ep{i}/t5") for i in range(6)] == first  # later turns follow their episode


# ---- failures ----------------------------------------------------------------------------------


def test_dead_server_is_retried_then_a_typed_error():
    engine = SGLangEngine(["http://127.0.0.1:9"], max_retries=2, backoff_s=0.05)

    async def run():
        try:
            await engine.agenerate(GenRequest("ep/t0", [1, 2, 3], SamplingParams(4)))
        finally:
            await engine.aclose()

    with pytest.raises(EngineError, match="failed after 3 attempts"):
        asyncio.run(run())
    assert engine.stats["retries"] == 2


@pytest.mark.process
def test_server_restart_mid_request_is_retried(tiny_dir, tokenizer, tmp_path):
    cfg = EngineConfig(backend="serve-model")
    port = free_port("127.0.0.1")
    command = server_command(cfg, str(tiny_dir), "float32", port, 0)

    def start() -> subprocess.Popen:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    group = ServerGroup([f"http://127.0.0.1:{port}"], [start()], [tmp_path / "none.log"])
    wait_healthy(group, 120)
    engine = SGLangEngine(group.addresses, max_retries=40, backoff_s=0.25)

    async def run():
        task = asyncio.ensure_future(
            engine.agenerate(GenRequest("ep/t0", prompt(tokenizer), SamplingParams(2000, ignore_eos=True)))
        )
        await asyncio.sleep(0.5)
        group.procs[0].send_signal(signal.SIGKILL)  # dies mid-generation
        group.procs[0].wait()
        group.procs[0] = await asyncio.to_thread(start)
        try:
            return await task
        finally:
            await engine.aclose()

    try:
        r = asyncio.run(run())
    finally:
        group.stop()
    assert len(r.output_tokens) == 2000 and r.stop_reason == "length" and engine.stats["retries"] >= 1


@pytest.mark.process
def test_launcher_errors_name_the_problem(tmp_path):
    with pytest.raises(EngineError, match=r"has no sglang module; .*docs/sglang.md"):  # .venv has no SGLang
        launch_servers(EngineConfig(backend="sglang"), "Qwen/Qwen2.5-0.5B-Instruct", log_dir=tmp_path)
    with pytest.raises(EngineError, match="exited with code .* during start-up"):
        launch_servers(EngineConfig(backend="serve-model"), str(tmp_path / "no-such-model"), log_dir=tmp_path)


@pytest.mark.process
def test_serve_model_cli_help_lists_the_sglang_flags():
    out = subprocess.run(
        [sys.executable, "-m", "areal_agents.cli", "serve-model", "--help"], capture_output=True, text=True
    )
    for flag in ("--model-path", "--host", "--port"):
        assert flag in out.stdout


def test_kv_dtype_reaches_the_engine_the_run_opens(tiny_dir, tmp_path):
    """engine.kv_dtype: the in-process engine, the engine process and launched serve-model servers."""
    from areal_agents.cli import build_parser
    from areal_agents.engines.local_servers import open_engine

    engine, _ = open_engine(EngineConfig(kv_dtype="bfloat16"), str(tiny_dir), "float32", run_dir=tmp_path)
    assert engine.kv_dtype == torch.bfloat16
    command = server_command(EngineConfig(backend="serve-model", kv_dtype="bfloat16"), "m", "float32", 1, 0)
    assert command[command.index("--kv-dtype") + 1] == "bfloat16"
    args = build_parser().parse_args(command[command.index("serve-model") :])
    assert args.kv_dtype == "bfloat16"


def test_every_engine_option_reaches_a_launched_serve_model():
    """`EngineOptions` is one type: a launched server parses back every option its `EngineConfig` holds."""
    from areal_agents.cli import build_parser

    options = dict(max_running_requests=7, cpu_threads=2, prefix_cache_tokens=99, stale_kv="keep", kv_dtype="float16")
    cfg = EngineConfig(backend="serve-model", fast_decode=False, **options)
    command = server_command(cfg, "m", "float32", 1, 0)
    args = build_parser().parse_args(command[command.index("serve-model") :])
    parsed = EngineOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineOptions)})
    assert parsed == EngineOptions(fast_decode=False, **options)


def test_fast_decode_switch_reaches_the_engine_the_run_opens(tiny_dir, tmp_path):
    """engine.fast_decode=false: the in-process engine and launched serve-model servers decode through
    transformers' forward."""
    from areal_agents.cli import build_parser
    from areal_agents.engines.local_servers import open_engine

    engine, _ = open_engine(EngineConfig(), str(tiny_dir), "float32", run_dir=tmp_path)
    assert engine._runner.decode_step is not None  # the tiny model is a Llama
    engine, _ = open_engine(EngineConfig(fast_decode=False), str(tiny_dir), "float32", run_dir=tmp_path)
    assert engine._runner.decode_step is None
    for fast in (True, False):
        command = server_command(EngineConfig(backend="serve-model", fast_decode=fast), "m", "float32", 1, 0)
        assert ("--no-fast-decode" in command) != fast
        assert build_parser().parse_args(command[command.index("serve-model") :]).fast_decode == fast
