"""The env-step servers of the three languages, driven the way a training run drives them, in the same run.

    .venv/bin/python bench/env_servers_by_language.py [--seconds 3]

Each server runs its own example env, every one a few microseconds of work a step: Python's `serve-env`
(Arithmetic-v0, thread mode, 4 workers), sdk/cpp's guess_number (GuessNumber-v0) and sdk/java's GridPuzzle
(GridPuzzle-v0), so the figures are the servers' own cost. `RemoteEnvPool` plays 64 and 256 sessions at
once, batched (`POST /v1/step`, a run's default) and one request a step; an episode that ends is reset and
played on (resets are counted apart). Prints steps/s and p50/p99 step latency, and each server's ratio to
Python's. Client and servers share this machine's cores. Needs the SDKs' toolchains (setup.sh --with-sdks).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from areal_agents.envs.runtime.remote import EnvServerProcess, RemoteEnvPool
from areal_agents.net import free_port, wait_healthy

SDK = Path(__file__).resolve().parents[1] / "sdk"


@contextlib.contextmanager
def python_server():
    with EnvServerProcess(workers=4, max_sessions=4096) as server:
        yield server.url, "areal_agents/Arithmetic-v0", {"max_turns": 10**9}


@contextlib.contextmanager
def sdk_server(command: list[str], env_id: str, kwargs: dict):
    port = free_port()
    process = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(url, 60, alive=lambda: process.poll() is None, poll_s=0.1):
            raise RuntimeError(f"{' '.join(command)} did not answer /health")
        yield url, env_id, kwargs
    finally:
        process.terminate()
        process.wait(timeout=10)


def build(out: Path) -> dict[str, list[str]]:
    """The C++ and Java example servers, built into ``out``; the command that starts each."""
    quiet = {"check": True, "capture_output": True}
    subprocess.run(["cmake", "-S", SDK / "cpp", "-B", out / "cpp", "-DCMAKE_BUILD_TYPE=Release"], **quiet)
    subprocess.run(["cmake", "--build", out / "cpp", "-j2", "--target", "guess_number"], **quiet)
    sources = [*sorted((SDK / "java" / "src" / "arealagents").glob("*.java")), SDK / "java/examples/GridPuzzle.java"]
    subprocess.run(["javac", "-d", out / "java", *sources], **quiet)
    return {"cpp": [str(out / "cpp" / "guess_number")], "java": ["java", "-cp", str(out / "java"), "GridPuzzle"]}


async def drive(url: str, env_id: str, kwargs: dict, sessions: int, seconds: float, batch: bool) -> dict:
    pool = RemoteEnvPool(url, batch_steps=batch, max_connections=min(sessions, 64))
    envs = [pool.make(env_id, **kwargs) for _ in range(sessions)]
    await asyncio.gather(*(env.areset(seed=i) for i, env in enumerate(envs)))
    latencies: list[float] = []
    resets = 0
    deadline = time.perf_counter() + seconds

    async def play(env, seed: int) -> None:
        nonlocal resets
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            _, _, terminated, truncated, _ = await env.astep("0")
            latencies.append(time.perf_counter() - start)
            if terminated or truncated:
                resets += 1
                await env.areset(seed=seed + resets)

    start = time.perf_counter()
    await asyncio.gather(*(play(env, i) for i, env in enumerate(envs)))
    elapsed = time.perf_counter() - start
    await asyncio.gather(*(env.aclose() for env in envs))
    await pool.aclose()
    ms = np.array(latencies) * 1000
    return {
        "steps_per_s": len(latencies) / elapsed,
        "p50": np.percentile(ms, 50),
        "p99": np.percentile(ms, 99),
        "resets": resets,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    args = parser.parse_args()
    loads = [(64, True), (256, True), (64, False)]
    with tempfile.TemporaryDirectory() as tmp:
        commands = build(Path(tmp))
        servers = {
            "python": python_server(),
            "cpp": sdk_server(commands["cpp"], "cpp/GuessNumber-v0", {"high": 10, "max_turns": 10**9}),
            "java": sdk_server(commands["java"], "java/GridPuzzle-v0", {"size": 9, "max_turns": 64}),
        }
        print(f"== bench/env_servers_by_language ({args.seconds:.0f}s a measurement) ==")
        results: dict[tuple[str, int, bool], dict] = {}
        for name, server in servers.items():
            with server as (url, env_id, kwargs):
                for sessions, batch in loads:
                    r = asyncio.run(drive(url, env_id, kwargs, sessions, args.seconds, batch))
                    results[name, sessions, batch] = r
                    ratio = r["steps_per_s"] / results["python", sessions, batch]["steps_per_s"]
                    how = "batched" if batch else "1 request a step"
                    print(
                        f"{name:6s} {sessions:3d} sessions, {how:16s} {r['steps_per_s']:8,.0f} steps/s  "
                        f"p50 {r['p50']:6.2f} ms  p99 {r['p99']:7.2f} ms  ({r['resets']} resets) | "
                        f"vs python {ratio:.2f}x"
                    )


if __name__ == "__main__":
    main()
