"""The code judge on hostile completions, with a stand-in sandbox (no bubblewrap needed): fence extraction
is linear, and driver output it cannot parse fails that test instead of raising."""

import re

from areal_agents.rewards.code_judge import CodeJudge, extract_code, fenced_blocks
from areal_agents.sandbox.base import ExecResult


def test_fence_extraction_is_linear_on_megabytes(finishes_within):
    # 250,000 fences with no newline after any: the regex this replaced backtracked over the rest of the
    # text from each one (hours); a real block after 2 MB of prose.
    assert finishes_within(2.0, extract_code, "```a" * 250_000) is None
    assert finishes_within(2.0, extract_code, "x" * 2_000_000 + "```python\nprint(1)\n```") == "print(1)\n"
    assert fenced_blocks("```py run\nA```\n```\nB```") == [("py run", "A"), ("", "B")]


def test_code_env_reads_actions_with_the_judges_fence_parser(finishes_within):
    # Code-v0's last block: (info string lower-cased, code), after any <think> block; linear like the judge's.
    from areal_agents.envs.code import _last_block

    assert _last_block("<think>```python run\nA```</think>\n```Python RUN \nB```") == ("python run", "B")
    assert _last_block("test:\n```python run\nA```\nthen\n```python\nB\n```") == ("python", "B\n")
    assert _last_block("no code here") is None
    assert finishes_within(2.0, _last_block, "```a" * 250_000) is None


class ForgingSandbox:
    """Answers every run with driver records the program could have forged, none of them well-formed."""

    def run(self, code, **kwargs):
        marker = re.search(r"__AREAL_[0-9a-f]{16}__", code).group(0)
        lines = [
            "[0, " + '"ok", ' + "[" * 100_000 + "]" * 100_000 + "]",  # past the JSON parser's recursion limit
            '[1, "ok", ' + "9" * 5_000 + "]",  # past Python's int digit limit
            "not json",
            "[2, 3]",
            '[[2], "ok", 1]',  # an unhashable index
        ]
        return ExecResult("".join(f"{marker}{line}\n" for line in lines), "", 0, "ok", 0.1)


def test_unparseable_driver_records_fail_their_tests_instead_of_raising(finishes_within):
    judge = CodeJudge(ForgingSandbox(), stop_on_first_failure=False)
    tests = [{"input": "1", "output": "1"}] * 3
    result = finishes_within(5.0, judge.judge_functional, "class Solution: pass", "f", tests)
    assert (result.passed, result.total, result.statuses) == (0, 3, ["runtime_error"] * 3)
