"""serve-model's limits seen from outside (issue 42, item 4): a body over ``--max-body-bytes`` is a 413 while it
is read and the costliest body under the caps does not hold /health for a second; weight-group inits run one at
a time and never block the other control routes; a paused server says so on /health, which the run's supervisor
and client read as alive (no restart), and the run's own servers take only the run's admin key.
(Malformed values, ``n``, disconnects, adapters: ``test_serve_model_clients.py``.)"""

import asyncio
import json
import sys
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from app_in_thread import serving_app

from areal_agents.config import EngineConfig
from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.local_servers import open_engine
from areal_agents.engines.model_server import ModelServerConfig, build_app
from areal_agents.engines.model_server import broadcast as receiving
from areal_agents.engines.supervisor import spawn_server, stop_process
from areal_agents.models import load_model, load_tokenizer
from areal_agents.net import free_port, wait_healthy

pytestmark = pytest.mark.slow
LIVE_S = 1.0  # /health answers within this while a body is read and parsed (the bound)


def call(url, path, body=None, *, key=None, timeout=30.0):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data, headers), timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, ConnectionError):  # not listening (yet, or any more)
        return None, None
    return status, json.loads(raw) if raw.strip() else None


@pytest.fixture(scope="module")
def cli_server(tiny_dir, tmp_path_factory):
    """``areal-agents serve-model`` as a process of its own (its defaults), so that what holds its event loop
    holds nothing here."""
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("cli") / "serve-model.log"
    command = [
        sys.executable,
        "-m",
        "areal_agents.cli",
        "serve-model",
        "--model-path",
        str(tiny_dir),
        "--port",
        str(port),
    ]
    proc = spawn_server(command, log)
    try:
        assert wait_healthy(url, 120, alive=lambda: proc.poll() is None), log.read_text()[-2000:]
        yield url
    finally:
        assert stop_process(proc)[0] in ("SIGTERM", "exited")


async def post_while_polling_health(url: str, path: str, data) -> tuple[int, str, list[float]]:
    """POST ``data`` (bytes, or an async iterator: chunked) to ``url + path`` while GETting /health every 20 ms:
    the reply's status and text, and how long each /health took."""
    latencies: list[float] = []
    done = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def poll() -> None:
            while not done.is_set():
                start = time.perf_counter()
                async with session.get(url + "/health") as r:
                    await r.read()
                latencies.append(time.perf_counter() - start)
                await asyncio.sleep(0.02)

        poller = asyncio.create_task(poll())
        try:
            async with session.post(url + path, data=data, headers={"Content-Type": "application/json"}) as r:
                status, text = r.status, await r.text()
        finally:
            done.set()
            await poller
    return status, text, latencies


def test_a_body_over_max_body_bytes_is_413_while_it_is_read(cli_server):
    big = b'{"input_ids": [' + b",".join([b"5"] * (17 << 20)) + b"]}"  # 34 MB: it held the event loop 16 s
    status, text, latencies = asyncio.run(post_while_polling_health(cli_server, "/generate", big))
    assert status == 413 and "over 16777216 bytes (--max-body-bytes)" in json.loads(text)["error"]["message"]
    assert max(latencies) < LIVE_S, latencies

    async def chunks():  # no Content-Length: counted while read
        for _ in range(40):
            yield b"[" + b"5," * (1 << 19)

    status, text, _ = asyncio.run(post_while_polling_health(cli_server, "/v1/completions", chunks()))
    assert status == 413 and "--max-body-bytes" in json.loads(text)["error"]["message"]
    assert call(cli_server, "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})[0] == 200


def test_the_costliest_body_under_the_caps_leaves_health_answering(cli_server):
    members = (1 << 18) - 16  # object members: the costliest JSON values to parse here (each counts 2: , and :)
    costly = b'{"input_ids": [{' + b",".join(b'"%d":1' % i for i in range(members)) + b"}]}"
    status, text, latencies = asyncio.run(post_while_polling_health(cli_server, "/generate", costly))
    assert status == 400 and "input_ids" in json.loads(text)["error"]["message"]
    assert max(latencies) < LIVE_S, latencies
    over = b'{"input_ids": [' + b",".join([b"5"] * (1 << 19)) + b"]}"
    status, text, _ = asyncio.run(post_while_polling_health(cli_server, "/generate", over))
    assert status == 400 and "JSON values, over 524288 (--max-json-values)" in json.loads(text)["error"]["message"]


def test_weight_group_inits_run_one_at_a_time_and_never_block_the_other_control_routes(tiny_dir, monkeypatch):
    joining, most = [0], [0]
    real_join = receiving.join_group

    def join_group(*args, **kwargs):  # the real join, counted
        joining[0] += 1
        most[0] = max(most[0], joining[0])
        try:
            return real_join(*args, **kwargs)
        finally:
            joining[0] -= 1

    monkeypatch.setattr(receiving, "join_group", join_group)
    engine = HFEngine(load_model(tiny_dir), num_threads=1)
    app = build_app(engine, load_tokenizer(tiny_dir), ModelServerConfig(model_path=str(tiny_dir)))
    app.state.server.broadcast.timeout_s = 3.0  # each join waits this long for a peer that never comes
    replies = []
    with serving_app(app) as url:

        def init() -> None:  # rank 0 of 2 on a port of its own: it waits for rank 1 until its timeout
            body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 0, "world_size": 2}
            replies.append(call(url, "/init_weights_update_group", body, timeout=60))

        threads = [threading.Thread(target=init) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while joining[0] == 0:
            assert time.monotonic() < deadline, "no init started"
            time.sleep(0.01)
        assert call(url, "/pause_generation", {"mode": "in_place"})[0] == 200
        assert call(url, "/continue_generation", {})[0] == 200
        assert call(url, "/health")[0] == 200
        assert joining[0] == 1  # answered while a join was still waiting for its peer
        for t in threads:
            t.join(60)
    assert most[0] == 1  # never two joins at once
    assert sorted(status for status, _ in replies) in ([400, 400, 400], [400, 400, 409], [400, 409, 409]), replies
    assert all("Failed to init group" in r["message"] or "another group init" in r["message"] for _, r in replies)


def test_a_paused_server_says_so_and_the_runs_supervisor_and_client_leave_it_running(tiny_dir, tmp_path, capsys):
    cfg = EngineConfig(backend="serve-model", device="cpu", startup_timeout_s=120)
    engine, servers = open_engine(cfg, str(tiny_dir), "float32", run_dir=tmp_path)
    url, supervisor = servers.addresses[0], servers.supervisor
    supervisor.check_every_s, supervisor.paused_warn_s = 0.1, 0.5
    model = load_model(tiny_dir)

    async def run() -> None:
        try:
            assert servers.admin_key and engine.admin_key == servers.admin_key  # the run's own key, to both
            assert call(url, "/pause_generation", {})[0] == 401  # any other client: refused
            assert call(url, "/pause_generation", {}, key="guess")[0] == 401
            await engine.pause()
            status, body = call(url, "/health")
            assert status == 503 and body["status"] == "paused" and "/continue_generation" in body["error"]["message"]
            assert await engine.healthy(0)  # alive, paused on purpose
            deadline = time.monotonic() + 30
            while 0 not in supervisor.paused or time.monotonic() - supervisor.paused[0] < 1.0:
                assert time.monotonic() < deadline, "the supervisor never saw the pause"
                await asyncio.sleep(0.05)
            assert supervisor.restarts == []  # a 503 that says paused is no failure
            await engine.resume()
            assert call(url, "/health")[0] == 200
            await engine.update_weights(model.state_dict(), version=1)  # pause, load, resume: with the key
            assert call(url, "/get_weight_version")[1] == {"weight_version": "1"}
            while 0 in supervisor.paused:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        finally:
            await engine.aclose()

    try:
        asyncio.run(run())
    finally:
        servers.stop()
    assert supervisor.restarts == []
    assert "has been paused for" in capsys.readouterr().err  # reported once past paused_warn_s


def test_the_admin_key_reaches_a_restarted_server(tiny_dir, tmp_path):
    """A server the supervisor restarts takes the same key (from its environment, not its command line)."""
    cfg = EngineConfig(backend="serve-model", device="cpu", startup_timeout_s=120)
    engine, servers = open_engine(cfg, str(tiny_dir), "float32", run_dir=tmp_path)
    url = servers.addresses[0]
    servers.supervisor.check_every_s = 0.1
    try:
        first = servers.procs[0]
        assert servers.admin_key not in " ".join(first.args)
        first.kill()
        deadline = time.monotonic() + 120
        while not (servers.procs[0] is not first and call(url, "/health")[0] == 200):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert call(url, "/continue_generation", {})[0] == 401
        assert call(url, "/continue_generation", {}, key=servers.admin_key)[0] == 200
    finally:
        asyncio.run(engine.aclose())
        servers.stop()
