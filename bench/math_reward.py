"""Math reward: agreement on the math-verify equivalence cases, and service throughput vs raw math-verify.

    .venv/bin/python bench/math_reward.py [--cases tests/fixtures/data/mathverify_cases.jsonl] [--repeats 3]

Agreement: `MathReward` with each case's comparison settings (extraction targets, precision, strict,
set relations) against ``expected``; every disagreement is listed. Throughput: the same pairs through a
`RewardService` with 2 workers against raw ``verify(parse(gold), parse(pred))`` in one process, both
warmed up first, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from areal_agents.data.builtin import BUILTIN
from areal_agents.data.jsonl import read_jsonl
from areal_agents.rewards.math_reward import MathReward, warm_up
from areal_agents.rewards.math_verifier import MathVerifyConfig
from areal_agents.rewards.service import RewardService

DEFAULT_CASES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "data" / "mathverify_cases.jsonl"


def case_config(case: dict) -> MathVerifyConfig:
    c = case["config"]
    if c["call"] == "default":  # MathReward's defaults, as the Math env uses them
        return MathVerifyConfig()
    # These cases pin math-verify's exact semantics, so no fallback extraction.
    if c["call"].startswith("verify("):  # math-verify's library defaults
        return MathVerifyConfig(boxed_match_priority=50, fallback_extraction=False)
    return MathVerifyConfig(
        targets=tuple(c["match_types"]),
        float_rounding=c["precision"],
        strict=c["strict"],
        allow_set_relation_comp=c["allow_set_relation_comp"],
        fallback_extraction=False,
    )


def raw_math_verify(cases: list[dict]) -> tuple[int, float]:
    from math_verify import parse, verify

    agree, start = 0, time.perf_counter()
    for case in cases:
        try:
            ok = verify(parse(case["gold"]), parse(case["pred"]))
        except Exception:
            ok = False
        agree += ok == case["expected"]
    return agree, time.perf_counter() - start


async def through_service(cases: list[dict], workers: int) -> tuple[list, float, dict]:
    service = RewardService(workers=workers, timeout=10.0, initializer=warm_up)
    try:
        await service.score(MathReward(), "\\boxed{1}", {"answer": "1"})  # wait until the workers are up
        service.latencies.clear()
        groups: dict[MathVerifyConfig, list[int]] = {}
        for i, case in enumerate(cases):
            groups.setdefault(case_config(case), []).append(i)
        results: list = [None] * len(cases)
        start = time.perf_counter()

        async def run(config: MathVerifyConfig, idx: list[int]) -> None:
            fn = MathReward(config=config)
            out = await service.score_batch(fn, [(cases[i]["pred"], {"answer": cases[i]["gold"]}) for i in idx])
            for i, r in zip(idx, out):
                results[i] = r

        await asyncio.gather(*(run(c, idx) for c, idx in groups.items()))
        elapsed = time.perf_counter() - start
        return results, elapsed, service.metrics()
    finally:
        await service.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=str(DEFAULT_CASES))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="passes over the cases for the throughput")
    args = parser.parse_args()
    cases = read_jsonl(args.cases)

    warm_up()  # the raw baseline gets the same warm start as the service's workers
    raw_agree, raw_seconds = raw_math_verify(cases * args.repeats)
    results, service_seconds, metrics = asyncio.run(through_service(cases * args.repeats, args.workers))
    results = results[: len(cases)]
    ours = [bool(r.details.get("correct")) for r in results]
    agree = sum(o == c["expected"] for o, c in zip(ours, cases))

    n = len(cases) * args.repeats
    raw_rate, service_rate = n / raw_seconds, n / service_seconds
    methods: dict[str, int] = {}
    for r in results:
        key = r.details.get("method", r.details.get("error", "?"))
        methods[key] = methods.get(key, 0) + 1
    print("== bench/math_reward ==")
    print(f"agreement:       {agree}/{len(cases)} (raw math-verify defaults: {raw_agree // args.repeats}/{len(cases)})")
    print(f"decided by:      {methods}")
    for o, c in zip(ours, cases):
        if o != c["expected"]:
            print(f"  disagree: expected {c['expected']} got {o}: gold {c['gold'][:40]!r} pred {c['pred'][:60]!r}")
    print(f"raw math-verify: {raw_rate:8.1f} pairs/s (1 process)")
    print(f"reward service:  {service_rate:8.1f} pairs/s ({args.workers} workers) = {service_rate / raw_rate:.1f}x raw")
    print(
        f"service latency: p50 {metrics['latency_p50_ms']:.1f} ms  p99 {metrics['latency_p99_ms']:.1f} ms "
        "(per worker round trip)"
    )
    print(f"timeouts {metrics['timeouts']:.0f}, errors {metrics['errors']:.0f}")

    # An RL-shaped load: AIME answers (integers) in boxed completions, 8 samples per problem, half wrong.
    aime = [row for name in ("aime24", "aime25") for row in read_jsonl(BUILTIN[name].path())]  # bundled
    rl_items = [
        {
            "gold": r["answer"],
            "pred": f"Reasoning... so the answer is $\\boxed{{{int(r['answer']) + k % 2}}}$.",
            "expected": k % 2 == 0,
            "config": {"call": "default"},
        }
        for r in aime
        for k in range(8)
    ]
    raw_agree, raw_seconds = raw_math_verify(rl_items)
    rl_results, rl_seconds, rl_metrics = asyncio.run(through_service(rl_items, args.workers))
    rl_agree = sum(bool(r.details.get("correct")) == c["expected"] for r, c in zip(rl_results, rl_items))
    print(
        f"AIME-shaped load ({len(rl_items)} boxed integer answers): raw {len(rl_items) / raw_seconds:.1f} pairs/s, "
        f"service {len(rl_items) / rl_seconds:.1f} pairs/s = {raw_seconds / rl_seconds:.1f}x raw "
        f"(agreement raw {raw_agree}, service {rl_agree}); p99 {rl_metrics['latency_p99_ms']:.1f} ms"
    )


if __name__ == "__main__":
    main()
