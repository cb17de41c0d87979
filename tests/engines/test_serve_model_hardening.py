"""serve-model survives any request (issue 26, item 2): bad requests are 400s naming the field, one
request's error fails it alone, a failed decode loop shows in /health and the launcher restarts the
server with the run's current weights, and SIGTERM always stops it.

Faults no request can cause any more are simulated, and the tests say so: in-process by patching the
engine, in a server process by `faulty_serve_model.py` (the real server with a faulty decode step).
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from areal_agents.config import EngineConfig
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.hf.request_checks import RequestError, RequestLimits, check_request
from areal_agents.engines.local_servers import ServerGroup, launch_servers, wait_healthy
from areal_agents.engines.sglang.client import SGLangEngine
from areal_agents.engines.supervisor import Supervisor, complete_safetensors, pushed_weights
from areal_agents.engines.weight_sync import write_weights
from areal_agents.errors import EngineError
from areal_agents.models import load_model
from areal_agents.net import free_port
from areal_agents.types import GenRequest, SamplingParams

FAULTY = Path(__file__).parent / "faulty_serve_model.py"
CONTEXT = 512  # the tiny model's max_position_embeddings
VOCAB = 101  # ... and its vocabulary


def call(url: str, path: str, body=None, timeout: float = 30.0):
    """(status, JSON or text) of a GET (no body) or POST; ``body`` a str is sent as it is; (None, None)
    if nothing listens."""
    data = None if body is None else (body if isinstance(body, str) else json.dumps(body)).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, ConnectionError):  # not listening (yet, or any more)
        return None, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def message(reply) -> str:
    return reply[1]["error"]["message"]


def start_faulty(model_dir, port: int, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        command = [sys.executable, str(FAULTY), str(model_dir), str(port)]
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_within(proc: subprocess.Popen, seconds: float) -> float:
    """SIGTERM ``proc``; the seconds it took to exit (fails the test past ``seconds``)."""
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"serve-model still running {seconds}s after SIGTERM")
    return time.monotonic() - start


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    group = launch_servers(EngineConfig(backend="serve-model"), str(tiny_dir), log_dir=tmp_path_factory.mktemp("logs"))
    yield group.addresses[0]
    group.stop()


# ---- every request is checked before the decode thread -------------------------------------------


@pytest.mark.process
def test_out_of_range_token_ids_are_400_naming_the_field_and_the_server_goes_on(server):
    for ids, field in (
        ([999999], "input_ids[0]"),
        ([5, -1], "input_ids[1]"),
        ([[1, 2], [3, VOCAB]], "input_ids[1][1]"),
    ):
        reply = call(server, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}, timeout=10)
        assert reply[0] == 400 and message(reply).startswith(f"{field}: token id"), reply
        assert f"vocabulary has {VOCAB} tokens" in message(reply)
    ok = call(server, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
    assert ok[0] == 200 and ok[1]["meta_info"]["completion_tokens"] == 3
    assert call(server, "/health")[0] == 200 and call(server, "/health_generate")[0] == 200


@pytest.mark.process
def test_a_prompt_past_the_context_is_400(server):
    reply = call(server, "/generate", {"input_ids": [5] * 5000})
    assert reply[0] == 400 and message(reply).startswith("input_ids: the prompt has 5000 tokens")
    assert "max_position_embeddings" in message(reply)
    reply = call(server, "/generate", {"text": ["12+3=", "1" * CONTEXT]})
    assert reply[0] == 400 and message(reply).startswith(f"text[1]: the prompt has {CONTEXT} tokens")


@pytest.mark.process
def test_max_new_tokens_is_capped_at_the_context_left_and_ends_with_length(server):
    body = {"input_ids": [5] * 500, "sampling_params": {"max_new_tokens": 100_000_000, "ignore_eos": True}}
    status, reply = call(server, "/generate", body, timeout=60)
    assert status == 200 and reply["meta_info"]["completion_tokens"] == CONTEXT - 500
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": CONTEXT - 500}


@pytest.mark.process
def test_malformed_bodies_are_400_not_500(server):
    bad = [
        ('{"input_ids": {"a": 1}}', "input_ids"),
        ('{"input_ids": [[1, 2], 3]}', "input_ids"),
        ('{"input_ids": [1, true]}', "input_ids[1]"),
        ('{"text": 5}', "text"),
        ('{"input_ids": [1], "sampling_params": "hot"}', "sampling_params"),
        ('{"input_ids": [1], "top_logprobs_num": "x"}', "top_logprobs_num"),
        ('{"input_ids": [1], "rid": {"a": 1}}', "rid"),
        ('{"input_ids": [1], "sampling_params": {"max_new_tokens": Infinity}}', "sampling_params"),
        ('{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "sampling_params.temperature"),
        ('{"input_ids": [1], "sampling_params": [{"top_k": 1}]}', None),  # fine: one entry per prompt
    ]
    for body, field in bad:
        status, reply = call(server, "/generate", body, timeout=10)
        if field is None:
            assert status == 200, (body, reply)
        else:
            assert status == 400 and field in reply["error"]["message"], (body, status, reply)


def test_the_in_process_engine_checks_requests_the_same_way(tiny_dir):
    engine = HFEngine(load_model(tiny_dir))

    async def run():
        for ids, match in (([999999], r"input_ids\[0\]: token id 999999"), ([-1], r"input_ids\[0\]: token id -1")):
            with pytest.raises(RequestError, match=match):
                await engine.agenerate(GenRequest("r", ids, SamplingParams(2)))
        with pytest.raises(RequestError, match="input_ids: the prompt has 600 tokens"):
            await engine.generate_once(GenRequest("r", [5] * 600, SamplingParams(2)))
        nan = SamplingParams(2)
        nan.temperature = float("nan")
        with pytest.raises(RequestError, match="sampling.temperature"):
            await engine.agenerate(GenRequest("r", [5], nan))
        return await engine.agenerate(GenRequest("r", [5] * 500, SamplingParams(10**8, ignore_eos=True)))

    try:
        long = asyncio.run(run())
    finally:
        engine.close()
    assert len(long.output_tokens) == CONTEXT - 500 and long.stop_reason == "length"
    assert isinstance(RequestError("x"), EngineError) and isinstance(RequestError("x"), ValueError)


def test_check_request_caps_and_leaves_short_requests_alone():
    limits = RequestLimits(vocab_size=10, context=8)
    short = GenRequest("r", [1, 2], SamplingParams(3))
    assert check_request(short, limits) is short
    capped = check_request(GenRequest("r", [1, 2, 3], SamplingParams(100)), limits)
    assert capped.sampling.max_new_tokens == 5  # 8 positions - 3 prompt tokens
    assert check_request(GenRequest("r", [9] * 100, SamplingParams(4)), RequestLimits(10)).sampling.max_new_tokens == 4


# ---- one request's error fails it alone --------------------------------------------------------------


def forward_logprobs(model, ids, n_out):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return torch.tensor([lp[len(ids) - n_out - 1 + i, ids[len(ids) - n_out + i]].item() for i in range(n_out)])


def run_with_a_poisoned_request(engine: HFEngine, n_tokens: int = 12):
    async def run():
        good = [GenRequest(f"good{i}", [5 + i, 6, 7], SamplingParams(n_tokens, ignore_eos=True)) for i in range(3)]
        poisoned = GenRequest("poisoned", [9, 9, 9], SamplingParams(n_tokens, ignore_eos=True))
        replies = await asyncio.gather(*(engine.agenerate(r) for r in [*good, poisoned]), return_exceptions=True)
        return good, replies

    return asyncio.run(run())  # the caller closes the engine


def assert_the_others_are_exact(tiny_dir, engine, good, replies):
    """The good requests finished with the logprobs of a full forward pass; the poisoned one alone failed."""
    reference = load_model(tiny_dir)
    for request, reply in zip(good, replies[:3]):
        assert len(reply.output_tokens) == 12 and reply.stop_reason == "length"
        expected = forward_logprobs(reference, request.input_ids + reply.output_tokens, 12)
        assert torch.allclose(torch.tensor(reply.output_logprobs), expected, atol=1e-4)
    assert engine.stats.failed == 1 and engine.health() is None


def test_an_error_in_one_prefill_fails_that_request_only_simulated_fault(tiny_dir):
    model = load_model(tiny_dir)
    engine = HFEngine(model, admission_window_s=0.05)  # the four arrive together: one prefill for all
    real_forward = engine._runner.forward

    def forward(contexts, adapters, decode=0):
        if any(c[:3] == (9, 9, 9) for c in contexts):
            raise RuntimeError("simulated fault in this request's prefill")
        return real_forward(contexts, adapters, decode)

    engine._runner.forward = forward
    good, replies = run_with_a_poisoned_request(engine)
    assert isinstance(replies[3], EngineError) and "'poisoned' failed in the engine" in str(replies[3])
    assert "simulated fault" in str(replies[3])
    assert_the_others_are_exact(tiny_dir, engine, good, replies)
    engine.close()


def test_a_failing_decode_step_is_redone_row_by_row_simulated_fault(tiny_dir):
    model = load_model(tiny_dir)
    engine = HFEngine(model, admission_window_s=0.05)
    real_decode = engine._runner.decode

    def decode(batch, version):
        if any(seq.rid == "poisoned" and len(seq.tokens) >= 4 and not seq.delivered for seq in batch.rows):
            raise RuntimeError("simulated fault in a decode step")
        return real_decode(batch, version)

    engine._runner.decode = decode
    good, replies = run_with_a_poisoned_request(engine)
    assert isinstance(replies[3], EngineError) and "simulated fault in a decode step" in str(replies[3])
    assert_the_others_are_exact(tiny_dir, engine, good, replies)  # redone alone, then back in the batch
    engine.close()


def test_non_finite_logits_fail_that_request_only(tiny_dir):
    """A temperature so small that logits / T overflows: its row cannot be sampled (a real fault). The request
    checks refuse such a temperature (a 400 over HTTP); one that skipped them (``checked=True``) fails alone."""
    engine = HFEngine(load_model(tiny_dir), admission_window_s=0.05)

    async def run():
        good = [engine.agenerate(GenRequest(f"g{i}", [5, i], SamplingParams(6, ignore_eos=True))) for i in range(3)]
        tiny = GenRequest("tiny-t", [5, 9], SamplingParams(6, temperature=1e-40))
        with pytest.raises(RequestError, match="sampling.temperature: expects 0 .greedy. or a finite number"):
            await engine.agenerate(tiny)
        bad = engine.generate_once(tiny, checked=True)
        return await asyncio.gather(*good, bad, return_exceptions=True)

    try:
        replies = asyncio.run(run())
    finally:
        engine.close()
    assert all(len(r.output_tokens) == 6 for r in replies[:3])
    assert isinstance(replies[3], EngineError) and "not finite" in str(replies[3])


# ---- a failed decode loop: 503, restart; SIGTERM always stops ---------------------------------------


@pytest.mark.process
def test_a_failed_decode_loop_is_503_on_health_and_the_supervisor_restarts_it_simulated_fault(tiny_dir, tmp_path):
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "faulty.log"
    group = ServerGroup([url], [start_faulty(tiny_dir, port, log)], [log])
    try:
        wait_healthy(group, 120)
        first = group.procs[0]
        started = time.monotonic()
        reply = call(url, "/generate", {"input_ids": [5, 6], "rid": "kill-the-loop"}, timeout=20)
        assert reply[0] == 503 and "simulated decode-loop fault" in message(reply)  # answered, not hung
        assert time.monotonic() - started < 10
        for path in ("/health", "/health_generate"):
            status, body = call(url, path)
            assert status == 503 and "decode thread failed" in body["error"]["message"]
        assert call(url, "/generate", {"input_ids": [5, 6]})[0] == 503

        def command_for(i, model_dir, tokenizer, version):
            return [sys.executable, str(FAULTY), model_dir, str(port)]

        group.supervisor = Supervisor(group, command_for, str(tiny_dir), check_every_s=0.2, startup_timeout_s=120)
        group.supervisor.start()
        deadline = time.monotonic() + 120
        while not (group.procs[0] is not first and call(url, "/health")[0] == 200):
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        restart = group.supervisor.restarts[0]
        assert "/health answered 503" in restart.reason and "decode thread failed" in restart.reason
        assert restart.stopped_by == "SIGTERM" and restart.stop_seconds < 10  # SIGTERM stops a dead-loop server
        assert call(url, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})[0] == 200
    finally:
        group.stop()


@pytest.mark.process
def test_sigterm_stops_a_server_whose_decode_thread_hangs_simulated_fault(tiny_dir, tmp_path):
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    proc = start_faulty(tiny_dir, port, tmp_path / "hang.log")
    try:
        wait_healthy(ServerGroup([url], [proc], [tmp_path / "hang.log"]), 120)
        stuck = threading.Thread(target=call, args=(url, "/generate", {"input_ids": [5], "rid": "hang"}, 60))
        stuck.daemon = True
        stuck.start()
        deadline = time.monotonic() + 30
        while call(url, "/health")[0] != 503:  # stall_s is 2 s in the faulty server
            assert time.monotonic() < deadline, "a hung decode step never showed in /health"
            time.sleep(0.2)
        assert "has not finished a step" in message(call(url, "/health_generate"))
        assert stop_within(proc, 15) < 15
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.process
def test_the_launcher_restarts_a_killed_server_with_the_runs_current_weights(tiny_dir, tmp_path):
    weights_dir = tmp_path / "engine_weights"
    cfg = EngineConfig(backend="serve-model")
    group = launch_servers(cfg, str(tiny_dir), log_dir=tmp_path / "servers", weights_dir=weights_dir)
    url = group.addresses[0]
    group.supervisor.check_every_s = 0.2
    new = load_model(tiny_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * torch.randn_like(p))
    greedy = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "return_logprob": True,
    }

    async def push():
        engine = SGLangEngine(group.addresses, weights_dir=str(weights_dir))
        try:
            await engine.update_weights(new.state_dict(), version=3)
        finally:
            await engine.aclose()

    try:
        before = call(url, "/generate", greedy)[1]
        asyncio.run(push())
        pushed = call(url, "/generate", greedy)[1]
        assert pushed["meta_info"]["weight_version"] == "3"
        assert pushed["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
        first = group.procs[0]
        os.killpg(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not (group.procs[0] is not first and call(url, "/health")[0] == 200):
            assert time.monotonic() < deadline, group.logs[0].read_text()[-2000:]
            time.sleep(0.2)
        assert "exited with code -9" in group.supervisor.restarts[0].reason
        assert call(url, "/get_weight_version")[1] == {"weight_version": "3"}
        again = call(url, "/generate", greedy)[1]  # the pushed weights, not the starting checkpoint
        assert again["output_ids"] == pushed["output_ids"] and again["meta_info"]["weight_version"] == "3"
        for (a, _, _), (b, _, _) in zip(
            again["meta_info"]["output_token_logprobs"], pushed["meta_info"]["output_token_logprobs"]
        ):
            assert abs(a - b) < 1e-4
    finally:
        group.stop()


def test_only_complete_weights_pushed_since_the_launch_count(tmp_path, tiny_dir):
    state = {"w": torch.ones(4)}
    for version in (1, 2, 3):
        write_weights(state, tmp_path / f"v{version}")
    since = time.time() - 60
    os.utime(tmp_path / "v3" / "model.safetensors", (since - 100, since - 100))  # an earlier run's
    assert pushed_weights(tmp_path, since).version == "2"
    data = (tmp_path / "v2" / "model.safetensors").read_bytes()
    (tmp_path / "v2" / "model.safetensors").write_bytes(data[:-3])  # still being written
    assert not complete_safetensors(tmp_path / "v2" / "model.safetensors")
    assert pushed_weights(tmp_path, since).version == "1"
    assert pushed_weights(tmp_path / "none", since) is None


@pytest.mark.process
def test_a_503_is_restarted_after_failing_s_and_an_exited_process_at_once(tmp_path):
    """The supervisor's policy against a stand-in server (always 503) and stand-in processes (sleep)."""
    import http.server

    class Always503(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "SGLang is paused"}}')

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Always503)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"

    def sleeper(*_):
        return subprocess.Popen(["sleep", "60"], start_new_session=True)

    log = tmp_path / "x.log"
    group = ServerGroup([url], [sleeper()], [log])
    supervisor = Supervisor(
        group, lambda *_: ["sleep", "60"], str(tmp_path), spawn=sleeper, check_every_s=0.1, failing_s=1.0,
        startup_timeout_s=0.2,
    )  # fmt: skip
    group.supervisor = supervisor.start()
    try:
        time.sleep(0.6)
        assert supervisor.restarts == []  # 503 for less than failing_s: left alone
        deadline = time.monotonic() + 10
        while not supervisor.restarts:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "503: SGLang is paused" in supervisor.restarts[0].reason
        assert supervisor.restarts[0].stopped_by == "SIGTERM"
        os.killpg(group.procs[0].pid, signal.SIGKILL)  # a process that exits is restarted at the next check
        while len(supervisor.restarts) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "exited with code -9" in supervisor.restarts[1].reason
    finally:
        group.stop()
        httpd.shutdown()
