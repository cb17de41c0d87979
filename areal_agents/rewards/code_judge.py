"""Judge code against tests in the sandbox, with LiveCodeBench's semantics.

- stdin/stdout tests: outputs compared line by line after stripping; a line that differs as text may
  still match token by token as decimal numbers (``1.0`` == ``1``), as LiveCodeBench's ``grade_stdio``.
- functional tests (LeetCode): newline-separated JSON arguments, JSON expected value, called on
  ``Solution().func_name`` (or a module-level function), all tests in one sandbox run with a per-test
  time limit.
- HumanEval (``check(entry_point)``) and MBPP (assert lists): the program passes when it exits cleanly.

    judge = CodeJudge()
    result = judge.judge_lcb(completion, row)      # JudgeResult(passed=..., total=..., reward=...)
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import secrets
import zlib
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from areal_agents.rewards.extract import strip_thinking
from areal_agents.sandbox import LocalSandbox, Sandbox

# What LiveCodeBench's harness puts before LeetCode solutions, so starter code's types resolve.
PRELUDE = (
    "from typing import *\nfrom collections import *\nfrom functools import *\nfrom itertools import *\n"
    "from heapq import *\nfrom bisect import *\nimport math, string, re, sys, copy, random, operator\n"
    "sys.setrecursionlimit(50000)\n"
)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(info string, code)`` of each fenced block: a line opened by three backticks, up to the next three
    backticks. The info string is the rest of the opening line, stripped (``python``, ``python run``: its
    first word is the language). Linear in the text (``str.find``, no regex backtracking), so megabytes of
    stray fences cost milliseconds. The one fence parser: the code judge and `Code-v0` both read it."""
    blocks: list[tuple[str, str]] = []
    pos = 0
    while (start := text.find("```", pos)) >= 0:
        newline = text.find("\n", start + 3)
        if newline < 0:
            break
        end = text.find("```", newline + 1)
        if end < 0:
            break  # no fence closes it, nor any later one
        blocks.append((text[start + 3 : newline].strip(), text[newline + 1 : end]))
        pos = end + 3
    return blocks


def extract_code(completion: str) -> str | None:
    """The last fenced code block of a completion (after any <think> block); None when there is none."""
    blocks = fenced_blocks(strip_thinking(completion))
    return blocks[-1][1] if blocks else None


class _StrOnly(pickle.Unpickler):
    """LiveCodeBench pickles a JSON string; refuse anything else (a dataset must not run code here)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a test-case payload")


def decode_tests(field_value: str | list | None) -> list[dict[str, Any]]:
    """Test cases as a list of dicts, from plain JSON or LiveCodeBench's base64(zlib(pickle(json)))."""
    if field_value is None:
        return []
    if isinstance(field_value, list):
        return field_value
    text = field_value.strip()
    if not text:
        return []
    if text[0] == "[":
        return json.loads(text)
    payload = _StrOnly(io.BytesIO(zlib.decompress(base64.b64decode(text)))).load()
    return json.loads(payload)


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(tok) for tok in line.split()]
    except InvalidOperation:
        return None


def stdout_matches(output: str, expected: str) -> bool:
    """LiveCodeBench's comparison of a program's stdout with the expected output."""
    got = [line.strip() for line in output.strip().split("\n")]
    want = [line.strip() for line in expected.strip().split("\n")]
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if a == b:
            continue
        da, db = _decimals(a), _decimals(b)
        if da is None or db is None or da != db:
            return False
    return True


@dataclass
class JudgeResult:
    passed: int
    total: int
    statuses: list[str] = field(default_factory=list)  # per test: pass, wrong_answer, or the sandbox status
    message: str = ""

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


class CodeJudge:
    """Runs tests in a `Sandbox`; ``stop_on_first_failure`` skips the rest after a failure (LCB's default)."""

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        *,
        timeout_s: float = 6.0,
        memory_mb: int = 1024,
        stop_on_first_failure: bool = True,
    ) -> None:
        self.sandbox = sandbox if sandbox is not None else LocalSandbox()
        self.timeout_s, self.memory_mb, self.stop = timeout_s, memory_mb, stop_on_first_failure

    # -- LiveCodeBench ----------------------------------------------------------------------

    def judge_lcb(self, completion: str, row: dict[str, Any], *, code_is_raw: bool = False) -> JudgeResult:
        """Public + private tests of a LiveCodeBench row against the completion's last code block."""
        code = completion if code_is_raw else extract_code(completion)
        tests = decode_tests(row.get("public_test_cases")) + decode_tests(row.get("private_test_cases"))
        if not tests:
            return JudgeResult(0, 0, message="the row has no tests")
        if code is None:
            return JudgeResult(0, len(tests), ["no_code"] * len(tests), "no fenced code block in the completion")
        if tests[0].get("testtype") == "functional":
            metadata = row.get("metadata") or "{}"
            func_name = (json.loads(metadata) if isinstance(metadata, str) else metadata).get("func_name")
            if not func_name:
                return JudgeResult(0, len(tests), message="functional tests need metadata.func_name")
            return self.judge_functional(code, func_name, tests)
        return self.judge_stdin(code, tests)

    def judge_stdin(self, code: str, tests: list[dict[str, Any]]) -> JudgeResult:
        statuses: list[str] = []
        for test in tests:
            r = self.sandbox.run(code, stdin=test["input"], timeout_s=self.timeout_s, memory_mb=self.memory_mb)
            if r.status != "ok":
                statuses.append(r.status)
            else:
                statuses.append("pass" if stdout_matches(r.stdout, test["output"]) else "wrong_answer")
            if self.stop and statuses[-1] != "pass":
                break
        return _result(statuses, len(tests))

    def judge_functional(self, code: str, func_name: str, tests: list[dict[str, Any]]) -> JudgeResult:
        marker = f"__AREAL_{secrets.token_hex(8)}__"
        driver = _FUNCTIONAL_DRIVER.format(
            tests=json.dumps([t["input"] for t in tests]),
            func=json.dumps(func_name),
            marker=json.dumps(marker),
            per_test=max(1, int(self.timeout_s)),
            stop=self.stop,
        )
        program = PRELUDE + code + "\n" + driver
        r = self.sandbox.run(program, timeout_s=self.timeout_s * len(tests) + 2, memory_mb=self.memory_mb)
        outputs = _driver_records(r.stdout, marker)
        statuses: list[str] = []
        for i, test in enumerate(tests):
            if i not in outputs:
                statuses.append(r.status if r.status != "ok" else "runtime_error")
            else:
                kind, value = outputs[i]
                if kind != "ok":
                    statuses.append(kind)
                else:
                    statuses.append("pass" if value == json.loads(test["output"]) else "wrong_answer")
            if self.stop and statuses[-1] != "pass":
                break
        return _result(statuses, len(tests))

    # -- whole programs (HumanEval, MBPP) -------------------------------------------------------

    def judge_program(self, program: str) -> JudgeResult:
        r = self.sandbox.run(program, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
        status = "pass" if r.status == "ok" else ("wrong_answer" if "AssertionError" in r.stderr else r.status)
        return JudgeResult(int(status == "pass"), 1, [status], r.stderr[-500:])

    def judge_humaneval(self, solution: str, row: dict[str, Any], *, whole_function: bool = False) -> JudgeResult:
        """``solution`` is the function body that follows ``row["prompt"]`` (as canonical_solution is), or
        with ``whole_function`` a complete definition (what chat models write), run after the prompt's imports."""
        glue = "\n" if whole_function else ""
        return self.judge_program(f"{row['prompt']}{glue}{solution}\n\n{row['test']}\n\ncheck({row['entry_point']})\n")

    def judge_mbpp(self, code: str, row: dict[str, Any], *, challenge: bool = False) -> JudgeResult:
        """The asserts of ``test_list`` after the code and the row's setup (which may use the code's classes)."""
        asserts = row["test_list"] + (row.get("challenge_test_list") or [] if challenge else [])
        return self.judge_program(f"{code}\n{row.get('test_setup_code') or ''}\n\n" + "\n".join(asserts) + "\n")


def _driver_records(stdout: str, marker: str) -> dict[int, tuple[str, Any]]:
    """Test index -> (kind, value) from the driver's marked lines; a malformed line (the program printed
    it, or it nests past the JSON parser's recursion limit) is skipped, so that test has no record."""
    outputs: dict[int, tuple[str, Any]] = {}
    for line in stdout.splitlines():
        if not line.startswith(marker):
            continue
        try:
            index, kind, value = json.loads(line[len(marker) :])
        except (ValueError, TypeError, RecursionError):
            continue
        if isinstance(index, int) and isinstance(kind, str):
            outputs[index] = (kind, value)
    return outputs


def _result(statuses: list[str], total: int) -> JudgeResult:
    return JudgeResult(sum(s == "pass" for s in statuses), total, statuses)


_FUNCTIONAL_DRIVER = """
import json as _json, signal as _signal
def _areal_timeout(*_):
    raise TimeoutError("test time limit")
_signal.signal(_signal.SIGALRM, _areal_timeout)
_areal_fn = getattr(Solution(), {func}) if "Solution" in globals() else globals()[{func}]
for _i, _inp in enumerate(_json.loads({tests!r})):
    _args = [_json.loads(_line) for _line in _inp.split("\\n") if _line.strip()]
    _signal.alarm({per_test})
    try:
        _out = _areal_fn(*_args)
        _signal.alarm(0)
        _rec = [_i, "ok", _json.loads(_json.dumps(_out))]
    except TimeoutError:
        _rec = [_i, "timeout", None]
    except Exception as _e:
        _signal.alarm(0)
        _rec = [_i, "runtime_error", repr(_e)[:200]]
    print({marker} + _json.dumps(_rec), flush=True)
    if {stop} and _rec[1] != "ok":
        break
"""
