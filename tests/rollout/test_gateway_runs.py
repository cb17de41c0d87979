"""`areal-agents train rollout.source=gateway` and `areal-agents serve-gateway` as users run them: real processes,
a client sending sessions over HTTP and posting each reward after the session ended; the sessions a
serve-gateway kept on disk trained by a later `train` (``gateway.replay_dir``)."""

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from areal_agents.rollout.gateway.store import read_sessions

pytestmark = [pytest.mark.process, pytest.mark.slow]


def cli(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "areal_agents.cli", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def gateway_url(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "gateway.json").exists():
            return json.loads((run_dir / "gateway.json").read_text())["url"]
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"no gateway: {proc.communicate()[1][-2000:]}")


def send_sessions(url: str, stop: threading.Event, limit: int | None = None) -> int:
    """Sessions of one call each, rewarded 1, 0, 1, ... after they ended, until ``stop`` or ``limit``."""
    sent = 0
    with httpx.Client(base_url=url, timeout=60) as http:
        for k in itertools.count():
            if stop.is_set() or (limit is not None and sent >= limit):
                return sent
            try:
                sid = http.post("/rl/sessions", json={"task": "add"}).json()["session_id"]
                body = {"messages": [{"role": "user", "content": f"{k % 10}+1="}]}
                reply = http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid})
                assert reply.status_code == 200, reply.text
                http.post(f"/rl/sessions/{sid}/end")
                http.post(f"/rl/sessions/{sid}/reward", json={"reward": float(k % 2)})
            except httpx.TransportError:
                return sent  # the run stopped serving
            sent += 1
    return sent


def write_config(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_run_trains_on_live_sessions_while_serving_them(tmp_path, tiny_dir):
    run = tmp_path / "rl"
    config = write_config(
        tmp_path / "rl.yaml",
        f"run_dir: {run}\nsteps: 3\nmodel: {{path: {tiny_dir}}}\n"
        "env: {id: areal_agents/Arithmetic-v0, kwargs: {digits: 1}}\neval: {num_problems: 8}\n"
        "rollout: {source: gateway, batch_size: 8, max_new_tokens: 4, max_staleness: 1}\n"
        "gateway: {port: 0}\nppo: {advantage: baseline}\n",
    )
    proc = cli("train", config, "--no-progress")
    stop = threading.Event()
    url = gateway_url(run, proc)
    sender = threading.Thread(target=send_sessions, args=(url, stop))
    sender.start()
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        stop.set()
        sender.join()
    assert proc.returncode == 0, err[-3000:]
    assert f"gateway: {url}" in out
    summary = json.loads((run / "summary.json").read_text())
    episodes = summary["episodes"]
    assert summary["engine_version"] == 3 and summary["steps"] == 3
    assert episodes["accepted"] + episodes["cancelled"] + episodes["rejected"] == episodes["submitted"] >= 24
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(run / "tensorboard")).Reload()
    handed_on = [e.value for e in scalars.Scalars("rollout/gateway_handed_on")]
    assert len(handed_on) == 3 and handed_on == sorted(handed_on) and handed_on[-1] >= 24
    assert "rollout/gateway_stale_dropped" in scalars.Tags()["scalars"]
    with pytest.raises(httpx.TransportError):  # the gateway stopped with the run
        httpx.get(f"{url}/health", timeout=5)


def test_serve_gateway_keeps_rewarded_sessions_that_a_later_run_trains_on(tmp_path, tiny_dir):
    served, kept = tmp_path / "served", tmp_path / "kept"
    config = write_config(
        tmp_path / "serve.yaml",
        f"run_dir: {served}\nmodel: {{path: {tiny_dir}}}\nrollout: {{max_new_tokens: 4}}\n"
        f"gateway: {{port: 0, trajectory_dir: {kept}}}\n",
    )
    proc = cli("serve-gateway", config)
    try:
        sent = send_sessions(gateway_url(served, proc), threading.Event(), limit=6)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert sent == 6 and "6 sessions kept" in out
    sessions = list(read_sessions(str(kept)))
    assert [s.reward for s in sessions] == [0.0, 1.0] * 3 and all(s.task == "add" for s in sessions)

    run = tmp_path / "replayed"
    config = write_config(
        tmp_path / "rl.yaml",
        f"run_dir: {run}\nsteps: 1\nmodel: {{path: {tiny_dir}}}\n"
        "env: {id: areal_agents/Arithmetic-v0, kwargs: {digits: 1}}\neval: {num_problems: 8}\n"
        "rollout: {source: gateway, batch_size: 6, max_new_tokens: 4}\n"
        f"gateway: {{port: 0, replay_dir: {kept}}}\nppo: {{advantage: baseline}}\n",
    )
    trained = cli("train", config, "--no-progress")
    out, err = trained.communicate(timeout=600)  # no live traffic: the six kept sessions are the step
    assert trained.returncode == 0, err[-3000:]
    assert "6 replayed sessions first" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 1 and summary["episodes"]["accepted"] == 6
