"""Isolated executions/s of `LocalSandbox` against bare `python3 -c` spawns, measured in the same run.

    .venv/bin/python bench/sandbox.py [--seconds 5]

Bare: ``subprocess.run([python3, "-c", "print(1)"])`` with no isolation at all. Sandbox: the same
program, fully isolated (bwrap namespaces, rlimits, unprivileged uid), at 1 and 2 concurrent runs.
Target (issue 5): >= 3x the bare spawn rate, fully isolated.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import json
from pathlib import Path

from areal_agents.rewards.code import CodeJudge
from areal_agents.sandbox import LocalSandbox

HUMANEVAL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "humaneval.jsonl"

PYTHON = "/usr/bin/python3"


def rate(fn, seconds: float, concurrency: int) -> float:
    deadline = time.perf_counter() + seconds
    count = [0] * concurrency

    def loop(i: int) -> None:
        while time.perf_counter() < deadline:
            fn()
            count[i] += 1

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(loop, range(concurrency)))
    return sum(count) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    sandbox = LocalSandbox()

    def bare() -> None:
        subprocess.run([PYTHON, "-c", "print(1)"], capture_output=True, check=True)

    def isolated() -> None:
        assert sandbox.run("print(1)").stdout == "1\n"

    print("== bench/sandbox ==")
    base = {c: rate(bare, args.seconds, c) for c in (1, 2)}
    for c in (1, 2):
        r = rate(isolated, args.seconds, c)
        print(
            f"{c} concurrent: bare python3 -c {base[c]:6.1f}/s | isolated sandbox {r:6.1f}/s = {r / base[c]:.2f}x bare"
        )

    if HUMANEVAL.is_file():
        rows = [json.loads(line) for line in open(HUMANEVAL)]
        judge = CodeJudge(sandbox)
        start = time.perf_counter()
        passed = sum(judge.judge_humaneval(r["canonical_solution"], r).all_passed for r in rows)
        elapsed = time.perf_counter() - start
        print(f"judge on HumanEval: {len(rows) / elapsed:.1f} problems/s, 1 worker ({passed}/{len(rows)} canonical pass)")


if __name__ == "__main__":
    main()
