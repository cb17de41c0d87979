"""What both SDKs' tests do: run a server subprocess (healthy, or the test fails showing what it said), send it
requests a byte at a time, and train two RL steps against an env server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from areal_agents.cli import main
from areal_agents.envs.runtime.conformance_probe import trickle
from areal_agents.net import wait_healthy

# (where a slow request is stuck, what its client sends at once, what it then sends a byte at a time)
SLOW_REQUESTS = [
    ("request line", b"", b"GET /health?" + b"x" * 100 + b" HTTP/1.1\r\nHost: t\r\n\r\n"),
    ("headers", b"GET /health HTTP/1.1\r\nHost: t\r\n", b"X-Slow: " + b"y" * 100 + b"\r\n\r\n"),
    (
        "body",
        b"POST /v1/sessions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 112\r\n\r\n",
        b'{"env_id": "' + b"z" * 98 + b'"}',
    ),
]


@contextmanager
def server_process(args: list[str], url: str, *, timeout: float = 60, **popen) -> Iterator[subprocess.Popen]:
    """``args`` started and answering ``url``/health within ``timeout`` s (else the test fails, showing what the
    server wrote to stderr); stopped on exit. Its stdout is a pipe unless ``popen`` says otherwise."""
    with tempfile.TemporaryFile("w+") as stderr:
        popen = {"stdout": subprocess.PIPE, "text": True, **popen}
        process = subprocess.Popen(args, stderr=stderr, **popen)
        try:
            if not wait_healthy(url, timeout, alive=lambda: process.poll() is None, poll_s=0.05):
                stderr.seek(0)
                pytest.fail(f"{' '.join(args[:4])} did not become healthy at {url}:\n{stderr.read()[-3000:]}")
            yield process
        finally:
            stop(process)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    if process.stdout:
        process.stdout.close()


def slow_requests(url: str, copies: int, every: float = 0.2) -> list[tuple[str, bytes | None, float]]:
    """Each of SLOW_REQUESTS on ``copies`` connections at once, a byte every ``every`` s (so no read waits long):
    (where it was stuck, what the server sent back (b"": closed without a word), seconds until it did)."""
    host, port = url.removeprefix("http://").split(":")

    async def one(what: str, head: bytes, rest: bytes) -> tuple[str, bytes | None, float]:
        started = time.monotonic()
        return what, await trickle(host, int(port), head, rest, every), time.monotonic() - started

    async def all_at_once() -> list[tuple[str, bytes | None, float]]:
        return await asyncio.gather(*(one(*request) for request in SLOW_REQUESTS for _ in range(copies)))

    return asyncio.run(all_at_once())


def train_two_steps(
    url: str,
    env_id: str,
    kwargs: dict,
    model: Path,
    run_dir: Path,
    eval_problems: int = 4,
    *,
    rollout: dict | None = None,
) -> dict:
    """``areal-agents train`` for 2 steps with episodes played on the env server at ``url``; its summary.
    ``rollout``: more settings of the rollout section (``{"agent": "module:Class"}`` for a multi-agent env)."""
    config = run_dir.parent / f"{run_dir.name}.yaml"
    rollout = {"batch_size": 4, "group_size": 4, "max_new_tokens": 4, **(rollout or {})}
    config.write_text(
        f"run_dir: {run_dir}\nsteps: 2\nmodel: {{path: {model}}}\n"
        f"env: {{id: {env_id}, backend: server, server_url: {url}, kwargs: {json.dumps(kwargs)}}}\n"
        f"rollout: {json.dumps(rollout)}\n"
        f"ppo: {{filter_zero_variance_groups: false}}\neval: {{num_problems: {eval_problems}, env_kwargs: {{}}}}\n"
    )
    assert main(["train", str(config), "--no-progress"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine_version"] == 2, summary  # one weight push a step
    return summary
