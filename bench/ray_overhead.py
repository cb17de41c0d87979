"""What running on Ray costs on one machine, measured in the same run.

    .venv/bin/python bench/ray_overhead.py [--model runs/arith/sft/model] [--steps 10] [--seconds 5]

1. The arithmetic recipe (``examples/arithmetic/rl.yaml``) for ``--steps`` steps: local (in-process
   engine), local with a serve-model server (the engine Ray uses), and ``launcher=ray`` (2 env servers,
   2 rollout workers, ``--ranks`` trainer ranks, one model server); end-to-end samples/s of the training
   steps (rollout waits + training + weight pushes; start-up and evaluation excluded) and the ratio
   ray / local.
2. Env steps/s through `RemoteEnvPool` with 1 and 2 env-server replicas (Ray actors), 256 sessions.

Everything shares this machine's cores (2 here): Ray's actors cannot add compute, only overhead;
on a cluster the replicas and workers bring their own nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "arithmetic" / "rl.yaml"


def train(model: str, steps: int, run_dir: Path, extra: list[str]) -> dict:
    args = [
        sys.executable, "-m", "areal_agents.cli", "train", str(RECIPE), f"model.path={model}", f"steps={steps}",
        f"run_dir={run_dir}", "eval.num_problems=16", "ppo.filter_zero_variance_groups=false", "--no-progress", *extra,
    ]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    start = time.perf_counter()
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"train {' '.join(extra)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text()) | {"command_seconds": time.perf_counter() - start}


async def drive(pool, sessions: int, seconds: float) -> float:
    envs = [pool.make("areal_agents/Arithmetic-v0", max_turns=10**9) for _ in range(sessions)]
    await asyncio.gather(*(e.areset(seed=i) for i, e in enumerate(envs)))
    steps, deadline = 0, time.perf_counter() + seconds

    async def one(env) -> None:
        nonlocal steps
        while time.perf_counter() < deadline:
            await env.astep("0")
            steps += 1

    start = time.perf_counter()
    await asyncio.gather(*(one(e) for e in envs))
    rate = steps / (time.perf_counter() - start)
    await asyncio.gather(*(e.aclose() for e in envs))
    await pool.aclose()
    return rate


def env_replicas(seconds: float, sessions: int) -> dict[int, float]:
    import ray

    from areal_agents.cluster.env_servers import EnvServers
    from areal_agents.config import EnvConfig

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    try:
        out = {}
        for replicas in (1, 2):
            servers = EnvServers.launch(EnvConfig(mode="inline"), replicas, 0.5, 0, 60)
            asyncio.run(drive(servers.pool(), sessions, 1.0))  # warm-up
            out[replicas] = asyncio.run(drive(servers.pool(), sessions, seconds))
            servers.kill()
        return out
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="starting model (default: a fresh tiny model)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2, help="trainer ranks of the Ray run")
    parser.add_argument("--seconds", type=float, default=5.0, help="per env-server measurement")
    parser.add_argument("--sessions", type=int, default=256)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ray-overhead-"))
    model = args.model
    if not model:
        from areal_agents.models import save_tiny_model

        model = str(save_tiny_model(tmp / "tiny"))
    print(f"== bench/ray_overhead: arithmetic recipe, {args.steps} steps, {os.cpu_count()} cores ==")
    cluster = [
        "launcher=ray", "ray.env_servers=2", "ray.rollout_workers=2", f"ray.trainer_ranks={args.ranks}",
        "ray.env_server_cpus=0.25", "ray.rollout_worker_cpus=0.25", "ray.trainer_cpus=0.25",
        "ray.engine_server_cpus=0.5",
    ]  # fmt: skip
    runs = {
        "local (in-process engine)": [],
        "local (serve-model server)": ["engine.backend=serve-model"],
        f"ray (2 env servers, 2 workers, {args.ranks} ranks)": cluster,
    }
    rates = {}
    for name, extra in runs.items():
        summary = train(model, args.steps, tmp / name.split()[0] / str(len(rates)), extra)
        rates[name] = summary["samples_per_s"]
        print(f"{name:45s}: {rates[name]:7.1f} samples/s (the whole command: {summary['command_seconds']:.0f}s)")
    local, serve, ray_rate = rates.values()
    print(f"ratio ray / local = {ray_rate / local:.2f}x | ray / local serve-model = {ray_rate / serve:.2f}x")

    steps = env_replicas(args.seconds, args.sessions)
    print(f"env steps/s, {args.sessions} sessions: 1 replica {steps[1]:,.0f} | 2 replicas {steps[2]:,.0f} "
          f"| ratio {steps[2] / steps[1]:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
