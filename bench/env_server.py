"""Env-step server throughput and latency against in-process stepping, measured in the same run.

    .venv/bin/python bench/env_server.py [--seconds 2] [--mode thread]

For a trivial env (Echo) and the arithmetic env: in-process steps/s; HTTP steps/s and p50/p99 latency
at 1, 64 and 256 concurrent sessions (one request per step); batched steps/s (256 sessions, steps
coalesced into POST /v1/step by RemoteEnvPool); and the overhead against in-process, as a ratio and
as milliseconds per step. Targets (issue 3): >= 4,000 batched steps/s, <= 0.3 ms overhead per step.
Client and server share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import areal_agents.envs.testing  # noqa: F401  (registers Echo)
from areal_agents.envs import make_env
from areal_agents.envs.runtime.remote import EnvServerProcess, RemoteEnvPool

# Multi-turn episodes that never end early, so every call is a step.
ENVS = {
    "echo": ("areal_agents_testing/Echo-v0", {"target": "never", "max_turns": 10**9}),
    "arithmetic": ("areal_agents/Arithmetic-v0", {"max_turns": 10**9}),
}


def in_process(env_id: str, kwargs: dict, seconds: float) -> float:
    env = make_env(env_id, **kwargs)
    env.reset(seed=0)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(100):
            env.step("0")
        n += 100
    return n / (time.perf_counter() - start)


async def over_http(url: str, env_id: str, kwargs: dict, sessions: int, seconds: float, batch: bool) -> dict:
    pool = RemoteEnvPool(url, batch_steps=batch, max_connections=min(sessions, 64))
    envs = [pool.make(env_id, **kwargs) for _ in range(sessions)]
    await asyncio.gather(*(e.areset(seed=i) for i, e in enumerate(envs)))
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def drive(env) -> None:
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            await env.astep("0")
            latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*(drive(e) for e in envs))
    elapsed = time.perf_counter() - start
    await asyncio.gather(*(e.aclose() for e in envs))
    await pool.aclose()
    lat = np.array(latencies) * 1000
    return {
        "steps_per_s": len(latencies) / elapsed,
        "p50": float(np.percentile(lat, 50)),
        "p99": float(np.percentile(lat, 99)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--mode", default="thread", choices=["inline", "thread", "process"])
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()

    print(f"== bench/env_server (server mode {args.mode}, {args.workers} workers, {args.seconds:.0f}s each) ==")
    with EnvServerProcess(mode=args.mode, workers=args.workers, module="areal_agents.envs.testing") as server:
        for name, (env_id, kwargs) in ENVS.items():
            base = in_process(env_id, kwargs, args.seconds)
            print(f"{name}: in-process {base:,.0f} steps/s")
            for sessions in (1, 64, 256):
                r = asyncio.run(over_http(server.url, env_id, kwargs, sessions, args.seconds, batch=False))
                print(
                    f"{name}: HTTP {sessions:>3} sessions {r['steps_per_s']:8,.0f} steps/s  "
                    f"p50 {r['p50']:6.2f} ms  p99 {r['p99']:6.2f} ms"
                )
            r = asyncio.run(over_http(server.url, env_id, kwargs, 256, args.seconds, batch=True))
            overhead_ms = 1000 / r["steps_per_s"] - 1000 / base
            print(
                f"{name}: batched 256 sessions {r['steps_per_s']:8,.0f} steps/s  p50 {r['p50']:6.2f} ms  "
                f"p99 {r['p99']:6.2f} ms | in-process/batched ratio {base / r['steps_per_s']:.1f}x | "
                f"overhead {overhead_ms:.3f} ms/step"
            )


if __name__ == "__main__":
    main()
