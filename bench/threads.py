"""Threads that fit the machine (issue 43): a short synchronous run of the arithmetic recipe, on an idle
machine and with one core kept busy by a ``yes`` process, before (the engine and the trainer on torch's
default intra-op threads: every core) and after (``engine.cpu_threads`` and ``ppo.cpu_threads`` auto).

    .venv/bin/python bench/threads.py [--sft-model runs/arith/sft/model] [--steps 15] [--repeats 2]
    .venv/bin/python bench/threads.py --sft-model runs/arith/sft/model --updates    # PPO updates alone

Every run is a fresh ``areal-agents train examples/arithmetic/rl.yaml`` process (thread counts are per
process), the settings alternating; prints the median seconds of the training steps (and the process's
wall time, start-up and the held-out evals included) and the busy/idle ratio of each setting, the before
runs being the baseline measured in the same session. Without ``--sft-model`` it first builds the tiny model
and runs the recipe's SFT (bench/e2e_arith.py's start). "Idle" is the host as it is: the load average is
printed with each run. ``--updates`` times the PPO update alone, in a thread with torch's default
threads and with auto's, idle and busy: what a team wider than its free cores costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from areal_agents.config.placement import team_threads, usable_cores

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "arithmetic" / "rl.yaml"


def train(out: Path, model: str, steps: int, keys: list[str], busy: bool) -> tuple[float, float]:
    """One synchronous run in its own process, with a ``yes`` process beside it when ``busy``: (seconds of
    its training steps, wall seconds of the process)."""
    run_dir = out / f"run_{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "areal_agents.cli", "train", str(RECIPE), f"run_dir={run_dir}"]
    cmd += [f"model.path={model}", f"steps={steps}", "rollout.max_staleness=0", *keys]
    hog = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if busy else None
    try:
        start = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - start
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["step_seconds"], wall


def updates(model: str, threads: int, busy: bool, reps: int = 6) -> list[float]:
    """Seconds of each of ``reps`` PPO updates of a recipe-sized batch (16 groups of 16, 24-token prompts,
    5 generated tokens) on a thread of its own with ``threads`` intra-op threads, a ``yes`` beside it if ``busy``."""
    from areal_agents.config import TrainConfig, load_config  # noqa: PLC0415
    from areal_agents.trainers.policy import load_trainable  # noqa: PLC0415
    from areal_agents.trainers.policy_api import TrainSpec  # noqa: PLC0415
    from areal_agents.types import Trajectory  # noqa: PLC0415

    cfg = load_config(TrainConfig, RECIPE, [f"model.path={model}"])
    policy = load_trainable("policy", TrainSpec.of(cfg, 0), model, model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (24,), generator=g).tolist() for _ in range(16)]
    batch = [
        Trajectory(prompts[i // 16] + torch.randint(3, 60, (5,), generator=g).tolist(), [0] * 24 + [1] * 5,
                   [0.0] * 24 + [-1.0] * 5, [-1] * 24 + [0] * 5, reward=float(i % 2), group_id=str(i // 16))
        for i in range(256)
    ]  # fmt: skip
    seconds: list[float] = []

    def run() -> None:
        torch.set_num_threads(threads)
        for _ in range(reps):
            start = time.perf_counter()
            policy.train_step(batch, torch.Generator().manual_seed(0))
            seconds.append(time.perf_counter() - start)

    hog = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if busy else None
    try:
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return seconds


def sft_model(out: Path, seed: int) -> str:
    sys.path.insert(0, str(ROOT / "bench"))
    from e2e_arith import prepare_sft  # noqa: PLC0415

    from areal_agents.trainers.sft_recipe import run_sft  # noqa: PLC0415

    torch.set_num_threads(team_threads())
    return run_sft(prepare_sft(out, seed), progress=False)["model"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-model", default=None, help="an SFT checkpoint of the recipe (default: build one)")
    parser.add_argument("--out", default="runs/bench_threads")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--updates", action="store_true", help="time PPO updates alone, on 1 and torch's threads")
    args = parser.parse_args()
    out = Path(args.out)
    model = args.sft_model or sft_model(out, seed=1)
    default = torch.get_num_threads()  # torch's default in a fresh process: every core (or OMP_NUM_THREADS)
    if args.updates:
        for _ in range(args.repeats):
            for threads in (default, team_threads()):
                for busy in (False, True):
                    load = os.getloadavg()[0]
                    seconds = " ".join(f"{s:.2f}" for s in updates(model, threads, busy))
                    label = "one core busy" if busy else "idle"
                    print(f"update, {threads} threads, {label:13}: {seconds} s  (load {load:.1f})")
        return
    settings = {
        f"before (engine {default}, trainer {default} threads: torch's default)": [
            f"engine.cpu_threads={default}",
            f"ppo.cpu_threads={default}",
        ],
        f"after  (auto: engine {team_threads()}, trainer {team_threads()})": [],
    }
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    print(f"{usable_cores()} usable cores; {args.steps} synchronous steps of examples/arithmetic/rl.yaml each run")
    for _ in range(args.repeats):
        for name, keys in settings.items():
            for busy in (False, True):
                load = os.getloadavg()[0]
                step_s, wall = train(out, model, args.steps, keys, busy)
                times.setdefault((name, busy), []).append((step_s, wall))
                label = "one core busy" if busy else "idle"
                print(f"  {name.split()[0]:6} {label:13} steps {step_s:6.1f} s  wall {wall:6.1f} s  (load {load:.1f})")
    medians = {k: (statistics.median(s for s, _ in v), statistics.median(w for _, w in v)) for k, v in times.items()}
    for name in settings:
        (idle, idle_wall), (busy, busy_wall) = medians[(name, False)], medians[(name, True)]
        print(
            f"{name}: idle {idle:5.1f} s, one core busy {busy:5.1f} s = {busy / idle:.2f}x"
            f"  (wall {idle_wall:.0f} / {busy_wall:.0f} s)"
        )
    (before, after) = settings
    for busy in (False, True):
        gain = medians[(before, busy)][0] / medians[(after, busy)][0]
        print(f"after vs before, {'one core busy' if busy else 'idle'}: {gain:.1f}x faster steps")


if __name__ == "__main__":
    main()
