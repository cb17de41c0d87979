"""Isolated executions/s of `LocalSandbox` against bare `python3 -c` spawns, measured in the same run.

    .venv/bin/python bench/sandbox.py [--seconds 5] [--humaneval 164]

Bare: ``subprocess.run([python3, "-c", "print(1)"])`` with no isolation at all. Sandbox: the same
program, fully isolated (bwrap namespaces, rlimits, no capabilities, unprivileged uid), at 1 and 2
concurrent runs: warm (the default: a fork server per slot clones each run) and cold (bwrap + python
started per run); then the code judge on the bundled HumanEval's canonical solutions. Target (issue 5):
>= 3x the bare spawn rate, fully isolated.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from areal_agents.data.builtin import BUILTIN
from areal_agents.data.jsonl import read_jsonl
from areal_agents.rewards.code_judge import CodeJudge
from areal_agents.sandbox import LocalSandbox

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
    parser.add_argument("--humaneval", type=int, default=164, help="HumanEval problems to judge (all 164)")
    args = parser.parse_args()
    sandbox, cold = LocalSandbox(), LocalSandbox(warm=False)

    def bare() -> None:
        subprocess.run([PYTHON, "-c", "print(1)"], capture_output=True, check=True)

    def isolated(box: LocalSandbox = sandbox) -> None:
        result = box.run("print(1)")
        assert result.stdout == "1\n", result

    print("== bench/sandbox ==")
    isolated()  # starts the fork servers' first slot
    for c in (1, 2):
        base = rate(bare, args.seconds, c)
        warm = rate(isolated, args.seconds, c)
        slow = rate(lambda: isolated(cold), args.seconds, c)
        print(
            f"{c} concurrent: bare python3 -c {base:6.1f}/s | isolated warm {warm:6.1f}/s = {warm / base:.2f}x bare"
            f" | isolated cold {slow:5.1f}/s = {slow / base:.2f}x"
        )

    rows = read_jsonl(BUILTIN["humaneval"].path())[: args.humaneval]
    judge = CodeJudge(sandbox)
    start = time.perf_counter()
    passed = sum(judge.judge_humaneval(r["canonical_solution"], r).all_passed for r in rows)
    elapsed = time.perf_counter() - start
    rate_s = len(rows) / elapsed
    print(f"judge on HumanEval (bundled): {rate_s:.1f} problems/s, 1 worker ({passed}/{len(rows)} canonical pass)")


if __name__ == "__main__":
    main()
