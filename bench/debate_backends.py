"""The debate recipe in one process, behind serve-env (env.backend=server) and on Ray, from the same SFT model and seed.

    .venv/bin/python bench/debate_backends.py --sft-model runs/debate/sft/model [--rl-steps 30] [--problems 200]

Each run is ``areal-agents train examples/debate/rl.yaml`` with one override of where the env runs: in the
driver (``env.backend=local``), in serve-env processes the run starts (``env.backend=server``, Debate-v0 over
the env-step protocol's v2), or behind Ray env-server actors with Ray rollout workers (``launcher=ray``).
The same seed gives the same data order; sampling differs by the processes' timing, so the held-out
accuracies should agree within noise, not to the digit. Prints each run's accuracy before and after, its
per-agent final reward and its wall time, and the largest gap to the in-process run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "debate" / "rl.yaml"
RAY = [
    "launcher=ray", "ray.env_servers=1", "ray.rollout_workers=1", "ray.trainer_ranks=1", "ray.env_server_cpus=0.25",
    "ray.rollout_worker_cpus=0.25", "ray.trainer_cpus=0.25", "ray.engine_server_cpus=0.5",
]  # fmt: skip
BACKENDS = {
    "in-process": [],
    "serve-env (v2)": ["env.backend=server"],
    "ray": RAY,
}


def last_rewards_by_agent(log_dir: Path) -> dict[str, float]:
    """The last logged ``.../reward_agent/ID`` of each agent, from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0}).Reload()
    tags = [t for t in events.Tags()["scalars"] if "/reward_agent/" in t]
    return {t.rsplit("/", 1)[1]: events.Scalars(t)[-1].value for t in tags}


def run(name: str, extra: list[str], args: argparse.Namespace) -> dict:
    run_dir = Path(args.out) / name.split(" ")[0]
    overrides = [
        f"model.path={args.sft_model}", f"run_dir={run_dir}", f"steps={args.rl_steps}", f"seed={args.seed}",
        f"eval.num_problems={args.problems}", "--overwrite", "--no-progress", *extra,
    ]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "areal_agents.cli", "train", str(RECIPE), *overrides]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: train failed ({done.returncode}):\n{(done.stdout + done.stderr)[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    agents = last_rewards_by_agent(run_dir / "tensorboard")
    return {"seconds": time.perf_counter() - start, "before": summary["accuracy_before"],
            "after": summary["accuracy_after"], "agents": agents}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-model", required=True, help="the debate SFT model (bash examples/debate/run.sh steps=1)")
    parser.add_argument("--rl-steps", type=int, default=30)
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="runs/bench_debate_backends")
    parser.add_argument("--only", default="", help="comma-separated backends (default: all)")
    args = parser.parse_args()
    names = [n for n in BACKENDS if not args.only or n.split(" ")[0] in args.only.split(",")]
    results = {name: run(name, BACKENDS[name], args) for name in names}
    print(f"\n== bench/debate_backends: {args.rl_steps} steps, seed {args.seed}, {args.problems} held-out problems ==")
    for name, r in results.items():
        agents = ", ".join(f"{a} {v:.2f}" for a, v in sorted(r["agents"].items()))
        print(
            f"{name:15}: held-out {r['before']:6.1%} -> {r['after']:6.1%} | last step's reward by agent: {agents} "
            f"| {r['seconds']:.0f}s"
        )
    if "in-process" in results and len(results) > 1:
        base = results["in-process"]["after"]
        gap = max(abs(r["after"] - base) for r in results.values())
        print(f"largest gap to the in-process run after RL: {gap:.1%} (points)")


if __name__ == "__main__":
    main()
