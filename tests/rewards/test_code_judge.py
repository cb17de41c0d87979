"""The code judge on real datasets (the bundled sets and a test fixture): canonical solutions pass, mutated
ones fail (0 false passes)."""

import base64
import json
import pickle
import shutil
import zlib
from pathlib import Path

import pytest

from areal_agents.data.builtin import BUILTIN
from areal_agents.rewards.code_judge import CodeJudge, decode_tests, extract_code, stdout_matches

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "data"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def rows(name):
    """The rows of bundled set ``name``."""
    return [json.loads(line) for line in BUILTIN[name].path().read_text().splitlines()]


@pytest.fixture(scope="module")
def judge():
    return CodeJudge(timeout_s=10)


def test_extract_last_fenced_block():
    text = "<think>```python\nprint(0)\n```</think>Try:\n```python\nprint(1)\n```\nor better\n```py\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("no code") is None


def test_stdout_comparison_is_lcb_like():
    assert stdout_matches("1 2\n3\n", "1 2\n3")
    assert stdout_matches("1.0 2\n", "1 2.00")  # numeric token-wise
    assert not stdout_matches("1 2\n", "1 3")
    assert not stdout_matches("YES\nNO", "YES")


def test_compressed_private_tests_decode_and_refuse_code():
    tests = [{"input": "1\n", "output": "2\n", "testtype": "stdin"}]
    blob = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()
    assert decode_tests(blob) == tests

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        decode_tests(evil)


@pytest.mark.slow
def test_all_humaneval_canonical_solutions_pass_and_mutants_fail(judge):
    data = rows("humaneval")
    failures = [r["task_id"] for r in data if not judge.judge_humaneval(r["canonical_solution"], r).all_passed]
    assert not failures
    mutant = (
        "\n_real = {entry}\ndef {entry}(*args, **kwargs):\n    r = _real(*args, **kwargs)\n"
        "    if isinstance(r, bool): return not r\n    if isinstance(r, (int, float)): return r + 1\n"
        "    if isinstance(r, str): return r + 'x'\n    if isinstance(r, (list, tuple)): return list(r) + [None]\n"
        "    return 0 if r is None else None\n"
    )
    false_passes = [
        r["task_id"]
        for r in data
        if judge.judge_humaneval(r["canonical_solution"] + mutant.format(entry=r["entry_point"]), r).all_passed
    ]
    assert not false_passes


@pytest.mark.process
def test_mbpp_samples_pass_and_off_by_one_mutants_fail(judge):
    data = rows("mbpp_test20")
    assert len(data) == 20
    for r in data:
        assert judge.judge_mbpp(r["code"], r).all_passed, r["task_id"]
        name = r["test_list"][0].split("assert ")[1].split("(")[0].strip()
        wrong = r["code"] + f"\n_real_{name} = {name}\ndef {name}(*a, **k):\n    return [_real_{name}(*a, **k)]\n"
        assert not judge.judge_mbpp(wrong, r).all_passed, r["task_id"]


@pytest.mark.process
def test_stdin_cases_give_exactly_their_expected_pass(judge):
    cases = [json.loads(line) for line in (FIXTURES / "code_stdin_verl_prime.jsonl").read_text().splitlines()]
    assert len(cases) == 12
    for r in cases:
        result = judge.judge_stdin(r["program"], [{"input": r["stdin"], "output": r["expected_stdout"]}])
        assert result.all_passed is r["expected_pass"], r["id"]


CORRECT = {
    "1873_A": "t = int(input())\nfor _ in range(t):\n    s = input().strip()\n"
    "    print('YES' if sum(a != b for a, b in zip(s, 'abc')) in (0, 2) else 'NO')\n",
    "2727": "class Solution:\n    def countSeniors(self, details: List[str]) -> int:\n"
    "        return sum(int(d[11:13]) > 60 for d in details)\n",
    "abc301_a": "n = int(input())\ns = input().strip()\nt, a = s.count('T'), s.count('A')\n"
    "if t != a:\n    print('T' if t > a else 'A')\nelse:\n    print('A' if s[-1] == 'T' else 'T')\n",
}
WRONG = {
    "1873_A": CORRECT["1873_A"].replace("in (0, 2)", "in (0, 1)"),
    "2727": CORRECT["2727"].replace("> 60", ">= 60"),
    "abc301_a": CORRECT["abc301_a"].replace("'A' if s[-1] == 'T' else 'T'", "'T'"),
}


@pytest.mark.process
@pytest.mark.parametrize("qid", list(CORRECT))
def test_livecodebench_hidden_tests_judge_correct_and_incorrect(judge, qid):
    (row,) = [r for r in rows("lcb_hidden3") if r["question_id"] == qid]
    good = judge.judge_lcb(f"Here:\n```python\n{CORRECT[qid]}```", row)
    assert good.all_passed and good.total == len(decode_tests(row["private_test_cases"])), good
    bad = judge.judge_lcb(f"```python\n{WRONG[qid]}```", row)
    assert not bad.all_passed and "wrong_answer" in bad.statuses
