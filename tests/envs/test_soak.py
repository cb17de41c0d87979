"""Soak: 100,000 steps over 256 sessions with 1% injected env errors; nothing lost, memory flat."""

import asyncio
from pathlib import Path

import pytest

from areal_agents.envs.runtime.remote import EnvServerProcess, RemoteEnvPool
from areal_agents.errors import EnvError

TOTAL_STEPS = 100_000
SESSIONS = 256


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.slow
def test_soak_every_episode_accounted_for_and_memory_flat():
    with EnvServerProcess(workers=4, module="areal_agents.envs.testing") as server:
        pid = server.process.pid
        ledger = {"started": 0, "completed": 0, "env_error": 0, "steps": 0}
        rss = {}

        async def worker(pool: RemoteEnvPool, k: int) -> None:
            env = pool.make("areal_agents_testing/Faulty-v0", max_turns=20, error_rate=0.01)
            seed = k * 1_000_000
            while ledger["steps"] < TOTAL_STEPS:
                seed += 1
                await env.areset(seed=seed)
                ledger["started"] += 1
                while True:
                    try:
                        _, _, terminated, truncated, _ = await env.astep("x")
                    except EnvError:
                        ledger["env_error"] += 1
                        break
                    ledger["steps"] += 1
                    if ledger["steps"] == 20_000 and "warm" not in rss:
                        rss["warm"] = rss_mb(pid)
                    if terminated or truncated:
                        ledger["completed"] += 1
                        await env.aclose()
                        break

        async def run() -> dict:
            pool = RemoteEnvPool(server.url)
            try:
                await asyncio.gather(*(worker(pool, k) for k in range(SESSIONS)))
                return await pool.metrics()
            finally:
                await pool.aclose()

        metrics = asyncio.run(run())
        rss["end"] = rss_mb(pid)

    assert ledger["steps"] >= TOTAL_STEPS
    assert ledger["completed"] + ledger["env_error"] == ledger["started"]
    assert ledger["env_error"] > 0
    assert metrics["sessions_open"] == 0
    assert metrics["sessions_created"] == ledger["started"]
    assert metrics["sessions_closed"] + metrics["sessions_failed"] == ledger["started"]
    assert metrics["errors"]["env_error"] == ledger["env_error"]
    print(f"soak: {ledger} server RSS MB after 20k steps {rss['warm']:.1f}, at the end {rss['end']:.1f}")
    assert rss["end"] - rss["warm"] < 15, rss  # MB: flat, not growing with steps
