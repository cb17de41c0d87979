import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

from areal_agents.data.builtin import BUILTIN
from areal_agents.rewards import verify_math
from areal_agents.rewards.math_reward import MathReward, warm_up
from areal_agents.rewards.math_verifier import MathVerifyConfig, check_math
from areal_agents.rewards.service import RewardService

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"


@pytest.mark.process  # all but the plain numbers go to math-verify's worker processes
@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("\\boxed{0.5}", "\\frac{1}{2}", True),
        ("The answer is $\\frac{1}{2}$.", "0.5", True),
        ("\\boxed{\\frac{2}{4}}", "1/2", True),
        ("\\boxed{50\\%}", "50", True),
        ("\\boxed{[1, 3)}", "[1,3)", True),
        ("\\boxed{(1, 3]}", "[1,3)", False),
        ("\\boxed{\\{1,2,3\\}}", "\\{3,2,1\\}", True),
        ("\\boxed{x=2}", "2", True),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
        ("\\boxed{025}", "25", True),
        ("\\boxed{24}", "25", False),
        ("\\boxed{12 \\text{ cm}}", "12", True),
        ("<think>It is 7</think> \\boxed{8}", "7", False),
        ("I give up.", "3", False),
    ],
)
def test_verify_math(completion, gold, expected):
    assert verify_math(completion, gold) is expected


@pytest.mark.process
def test_fast_path_settles_plain_numbers_without_sympy():
    assert check_math("\\boxed{1,000}", "1000").method == "fast"
    assert check_math("42", "42").method == "fast"
    assert check_math("\\boxed{\\sqrt{2}}", "\\sqrt{2}").method == "math_verify"


@pytest.mark.slow
def test_agreement_on_math_verify_cases():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from math_reward import case_config

    cases = [json.loads(line) for line in open(FIXTURES / "mathverify_cases.jsonl")]
    agree = sum(check_math(c["pred"], c["gold"], case_config(c)).correct == c["expected"] for c in cases)
    assert agree >= 268


STYLES = ("Thus the result is $\\boxed{{{}}}$.", "After simplifying, the answer is {}.", "Work above.\n{}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["math500", "aime24", "aime25"])
def test_gold_answers_verify_against_themselves_in_three_styles(name):
    rows = [json.loads(line) for line in BUILTIN[name].path().read_text().splitlines()]
    assert len(rows) == {"math500": 500, "aime24": 30, "aime25": 30}[name]
    items = [(style.format(r["answer"]), {"answer": r["answer"]}) for r in rows for style in STYLES]

    async def run():
        service = RewardService(workers=2, timeout=30.0, chunk_size=16, initializer=warm_up)
        try:
            return await service.score_batch(MathReward(), items)
        finally:
            await service.aclose()

    results = asyncio.run(run())
    failures = [(c, r.details) for (c, _), r in zip(items, results) if r.reward != 1.0]
    assert not failures, failures[:5]


ADVERSARIAL = {
    "huge power": "\\boxed{10^{10^{10^{10^{10}}}}}",
    "huge factorial": "\\boxed{(10^{10})!}",
    "deep braces": "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
    "100 KB": "x + " * 25_000 + "\\boxed{3}",
    "malformed": "\\boxed{\\frac{1}{ \\sqrt{ \\left( }",
    "unicode": "答案是 π ∞ 𝔸 \\boxed{½}",
    "tower in text": "so the answer is 9**9**9**9",
    "factorial in text": "The answer is 100000000!.",
    "nested fractions": "\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}",
    "3 MB": "7 " * 1_500_000,
    "unclosed braces": "\\boxed{" * 100_000,
}
SERVICE_CASES = ("huge power", "huge factorial", "deep braces", "100 KB", "malformed", "unicode")
NOT_COMPARED = {"refused", "timeout", "error"}  # the methods that come with a reason


@pytest.mark.process
def test_adversarial_inputs_return_in_bound_with_a_reason_in_process_from_a_thread(finishes_within):
    """verify_math called in this process, off the main thread (math-verify's signal timeouts cannot work
    there): each input returns a wrong answer within the bound, and says why when it was not compared."""
    config = MathVerifyConfig(timeout_s=0.5)
    bound = config.timeout_s + 8.0  # plus a replaced worker's start-up, on a loaded machine
    finishes_within(60.0, check_math, "\\boxed{\\sqrt{2}}", "\\sqrt{2}", config)  # the pool is up
    cases = {name: (completion, "4") for name, completion in ADVERSARIAL.items()}
    cases["hostile gold"] = ("\\boxed{7}", "10^{10^{10}}")
    checks = {name: finishes_within(bound, check_math, *case, config) for name, case in cases.items()}
    for name, check in checks.items():
        assert not check.correct and (check.method in NOT_COMPARED) == bool(check.reason), (name, check)
    assert checks["deep braces"].method == checks["unclosed braces"].method == "refused"
    assert checks["huge power"].method == checks["hostile gold"].method == "timeout"
    assert "timeout_s=0.5" in checks["huge power"].reason
    assert finishes_within(bound, verify_math, "\\boxed{\\frac{1}{2}}", "0.5", config)  # still serving


@pytest.mark.process
def test_adversarial_inputs_stay_within_the_timeout_and_the_pool_survives():
    timeout = 3.0

    async def run():
        service = RewardService(workers=2, timeout=timeout, initializer=warm_up)
        try:
            await service.score(MathReward(), "\\boxed{1}", {"answer": "1"})  # workers up
            timings = {}
            for name in SERVICE_CASES:
                completion = ADVERSARIAL[name]
                start = time.perf_counter()
                result = await service.score(MathReward(), completion, {"answer": "10^{10^{10}}"})
                timings[name] = (time.perf_counter() - start, result)
            healthy = await service.score(MathReward(), "\\boxed{\\frac{1}{2}}", {"answer": "0.5"})
            return timings, healthy, service.metrics()
        finally:
            await service.aclose()

    timings, healthy, metrics = asyncio.run(run())
    for name, (seconds, result) in timings.items():
        # the timeout plus a worker's replacement (a process start: seconds on 2 busy cores); unbounded without it
        assert seconds < timeout + 6.0, (name, seconds)
        assert result.reward == 0.0, (name, result)
    assert healthy.reward == 1.0  # the pool kept serving
    assert metrics["calls"] == len(SERVICE_CASES) + 2


@pytest.mark.process
def test_reward_errors_and_missing_keys_are_typed():
    async def run():
        service = RewardService(workers=1, timeout=5.0)
        try:
            return await service.score(MathReward(answer_key="solution"), "\\boxed{1}", {"answer": "1"})
        finally:
            await service.aclose()

    result = asyncio.run(run())
    assert result.reward == 0.0 and result.details["error"] == "reward_error"
    assert "key 'solution'" in result.details["message"]
