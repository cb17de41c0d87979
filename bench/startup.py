"""Start-up: wall seconds of `areal-agents` commands that should answer at once, against importing torch.

    .venv/bin/python bench/startup.py [--repeats 7]

Each command runs as a fresh ``python -m areal_agents.cli`` in the repo root this script sits in (so a
worktree of another commit measures that commit's code), output discarded; the commands alternate with the
baselines (``python -c pass``, ``python -c "import torch"``) round by round, in the same run. Target (issue
43): each at most 1 s on 2 cores. Figures are the min and median of ``--repeats`` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BASELINES = {"python -c pass": ["-c", "pass"], "python -c 'import torch'": ["-c", "import torch"]}
COMMANDS = [
    "--help",
    "envs",
    "datasets",
    "train --help",
    "train examples/arithmetic/rl.yaml steps=abc",
    "train missing.yaml",
]


def wall_s(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="rounds; each runs every command once")
    args = parser.parse_args()

    runs = {**BASELINES, **{f"areal-agents {c}": ["-m", "areal_agents.cli", *c.split()] for c in COMMANDS}}
    wall_s(runs["areal-agents --help"])  # warm the page cache and the bytecode
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, argv in runs.items():
            times[name].append(wall_s(argv))

    torch_s = statistics.median(times["python -c 'import torch'"])
    width = max(map(len, runs))
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"{name:<{width}}  min {min(ts):5.2f} s  median {median:5.2f} s  = {median / torch_s:4.2f}x import torch")
    slowest = max(statistics.median(times[f"areal-agents {c}"]) for c in COMMANDS)
    print(f"slowest command median {slowest:.2f} s (target <= 1 s)")


if __name__ == "__main__":
    main()
