"""`areal_agents/Code-v0`: solve a programming problem in turns: run code on the public tests, then submit.

Each action is read for its last fenced code block:
- a block whose info string ends in ``run`` (e.g. ```` ```python run ````) is executed in the sandbox on
  the problem's public tests (or with no input when there are none); the observation reports each test's
  verdict and the program's output. At most ``max_runs`` runs per episode.
- any other code block is the submission, judged on all its tests; reward 1 if all pass (or the fraction
  passed with ``partial_reward``); the episode ends.
- no code block: the agent is told so, and it costs a turn.

Rows may be LiveCodeBench's (``question_content``; stdin or functional tests, LCB's semantics), MBPP's
(``text`` + ``test_list``: the first assert is shown and is the public test) or HumanEval's (``prompt`` +
``entry_point``: the answer is the whole function).

    env = gymnasium.make("areal_agents/Code-v0")   # bundled MBPP train (task ids 601-974)
    env = gymnasium.make("areal_agents/Code-v0", dataset="lcb_v5", max_turns=4, max_runs=2)

Served (``serve-env``), every sandbox run of a reset or step ends by the server's step timeout, whatever
``timeout_s`` a client gives (`remaining_s`): a step that times out leaves no run holding a worker.
"""

from __future__ import annotations

import json
from typing import Any

from areal_agents.data.base import BaseDataset, load_task_dataset
from areal_agents.envs.base import TextEnv
from areal_agents.envs.runtime.budget import remaining_s
from areal_agents.rewards.code_judge import CodeJudge, JudgeResult, decode_tests, fenced_blocks, stdout_matches
from areal_agents.rewards.extract import strip_thinking
from areal_agents.sandbox import ExecResult, LocalSandbox, Sandbox

STDIN_INSTRUCTION = "Read the input from standard input, solve the problem and write the answer to standard output."
FUNCTIONAL_INSTRUCTION = "Complete this starter code:\n```python\n{starter}\n```"
MBPP_INSTRUCTION = "Write the function in a ```python block. Your code should pass this test:\n```python\n{test}\n```"
HUMANEVAL_INSTRUCTION = (
    "Complete this function; submit the whole function in a ```python block:\n```python\n{prompt}```"
)
HOW_TO = (
    "To test your code on the examples first, put it in a block opened with ```python run. "
    "Submit your final solution in a plain ```python block."
)
# row format -> (prompt key, id key); the format is read off the dataset's first row
FORMATS = {"lcb": ("question_content", "question_id"), "mbpp": ("text", "task_id"), "humaneval": ("prompt", "task_id")}


def row_format(row: dict[str, Any], source: str = "") -> str:
    """``lcb``, ``mbpp`` or ``humaneval``, by the keys of a dataset row."""
    if "question_content" in row:
        return "lcb"
    if "test_list" in row and "text" in row:
        return "mbpp"
    if "entry_point" in row and "test" in row:
        return "humaneval"
    raise ValueError(
        f"Expects rows of {source or 'the dataset'} in LiveCodeBench (question_content), MBPP (text, test_list) "
        f"or HumanEval (prompt, entry_point, test) form; the first row has keys {sorted(row)}"
    )


class CodeDataset(BaseDataset):
    """Rows in one of `FORMATS` (read off the first row); they keep their fields, ``prompt`` and ``id`` come from
    the format's keys."""

    def __init__(self, raw_rows: list[dict[str, Any]], *, prompt_key: str = "", id_key: str = "", source: str = ""):
        self.format = row_format(raw_rows[0], source) if raw_rows else "lcb"
        prompt_key, id_key = FORMATS[self.format]
        super().__init__(raw_rows, prompt_key=prompt_key, id_key=id_key, source=source)


def load_code_dataset(dataset: str, split: str | None) -> tuple[str, BaseDataset]:
    """``(row format, dataset)``, the dataset shared with every env over it (`load_task_dataset`)."""
    data = load_task_dataset(dataset, split=split, cls=CodeDataset)
    assert isinstance(data, CodeDataset)
    return data.format, data


# a sandbox run's address space: a client of serve-env names it, so it is bounded (the run is killed past it)
MIN_MEMORY_MB, MAX_MEMORY_MB = 64, 8192


class WithinCall:
    """A sandbox whose runs end by the current served call's deadline (`remaining_s`): each run's timeout is
    cut to the time left, and a run with none left is a timeout without running."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def _timeout(self, timeout_s: float) -> float | None:
        left = remaining_s()
        return timeout_s if left is None else (min(timeout_s, left) if left > 0.05 else None)

    def run(self, code: str, *, timeout_s: float = 10.0, **kwargs: Any) -> ExecResult:
        timeout = self._timeout(timeout_s)
        if timeout is None:
            return ExecResult("", "", None, "timeout", 0.0)
        return self.sandbox.run(code, timeout_s=timeout, **kwargs)

    async def arun(self, code: str, *, timeout_s: float = 10.0, **kwargs: Any) -> ExecResult:
        timeout = self._timeout(timeout_s)
        if timeout is None:
            return ExecResult("", "", None, "timeout", 0.0)
        return await self.sandbox.arun(code, timeout_s=timeout, **kwargs)


def _last_block(text: str) -> tuple[str, str] | None:
    """``(info string, code)`` of an action's last fenced block (after any <think> block), read by the code
    judge's parser (`fenced_blocks`); the info string lower-cased, so ```` ```Python RUN ```` runs."""
    blocks = fenced_blocks(strip_thinking(text))
    return (blocks[-1][0].lower(), blocks[-1][1]) if blocks else None


class CodeEnv(TextEnv):
    """A LiveCodeBench-style problem per episode, with code runs as tool calls before the submission."""

    def __init__(
        self,
        dataset: str = "mbpp",
        *,
        split: str | None = None,
        max_turns: int = 4,
        max_runs: int = 3,
        partial_reward: bool = False,
        timeout_s: float = 6.0,
        memory_mb: int = 1024,
        max_feedback_chars: int = 2000,
    ) -> None:
        super().__init__(max_observation_length=200_000, max_action_length=1_000_000)
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"Expects max_turns to be an int >= 1, got {max_turns!r}")
        if not isinstance(max_runs, int) or max_runs < 0:
            raise ValueError(f"Expects max_runs to be an int >= 0, got {max_runs!r}")
        if not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"Expects timeout_s to be a number > 0, got {timeout_s!r}")
        if not isinstance(memory_mb, int) or not MIN_MEMORY_MB <= memory_mb <= MAX_MEMORY_MB:
            raise ValueError(f"Expects memory_mb to be an int in [{MIN_MEMORY_MB}, {MAX_MEMORY_MB}], got {memory_mb!r}")
        self._data_args = (dataset, split)
        self.format, self.data = load_code_dataset(dataset, split)
        self.max_turns, self.max_runs, self.partial_reward = max_turns, max_runs, partial_reward
        self.max_feedback_chars = max_feedback_chars
        self.judge = CodeJudge(WithinCall(LocalSandbox()), timeout_s=timeout_s, memory_mb=memory_mb)
        self.row: dict[str, Any] | None = None
        self.turn = self.runs = 0

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["data"] = None  # reloaded from the per-process cache; process-mode pools pickle per call
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.format, self.data = load_code_dataset(*self._data_args)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        if options and "index" in options:
            index = int(options["index"])
        else:
            index = int(self.np_random.integers(len(self.data)))
        if not 0 <= index < len(self.data):
            raise ValueError(f"options['index'] must be in [0, {len(self.data)}), got {index}")
        self.row, self.turn, self.runs = self.data[index], 0, 0
        runs = f" {HOW_TO} You have {self.max_runs} run{'s' * (self.max_runs != 1)}." if self.max_runs else ""
        info = {"role": "user", "index": index, "id": self.row["id"], "num_problems": len(self.data)}
        if self.format == "humaneval":
            return HUMANEVAL_INSTRUCTION.format(prompt=self.row["prompt"]) + runs, info
        if self.format == "mbpp":
            instruction = MBPP_INSTRUCTION.format(test=self.row["test_list"][0])
        elif starter := (self.row.get("starter_code") or "").strip():
            instruction = FUNCTIONAL_INSTRUCTION.format(starter=starter)
        else:
            instruction = STDIN_INSTRUCTION
        return f"{self.row['prompt']}\n\n{instruction}{runs}", info

    def _judge(self, code: str) -> JudgeResult:
        """The submission on all of the problem's tests."""
        if self.format == "mbpp":
            return self.judge.judge_mbpp(code, self.row)
        if self.format == "humaneval":
            return self.judge.judge_humaneval(code, self.row, whole_function=True)
        return self.judge.judge_lcb(code, self.row, code_is_raw=True)

    def _run_feedback(self, code: str) -> str:
        lines = [f"Run {self.runs} of {self.max_runs}."]
        tests = decode_tests(self.row.get("public_test_cases")) if self.format == "lcb" else []
        if self.format == "mbpp":
            shown = {**self.row, "test_list": self.row["test_list"][:1]}
            r = self.judge.judge_mbpp(code, shown)
            lines.append(f"example 1: {r.statuses[0]}" + (f"\nstderr:\n{r.message}" if r.message else ""))
        elif self.format == "humaneval" or not tests:
            program = f"{self.row['prompt']}\n{code}" if self.format == "humaneval" else code
            r = self.judge.sandbox.run(program, timeout_s=self.judge.timeout_s, memory_mb=self.judge.memory_mb)
            lines.append(f"status: {r.status}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}")
        elif tests[0].get("testtype") == "functional":
            func = json.loads(self.row.get("metadata") or "{}").get("func_name", "")
            every_test = CodeJudge(self.judge.sandbox, timeout_s=self.judge.timeout_s, stop_on_first_failure=False)
            verdicts = every_test.judge_functional(code, func, tests).statuses
            lines += [f"example {i + 1}: {v}" for i, v in enumerate(verdicts)]
        else:
            for i, test in enumerate(tests):
                r = self.judge.sandbox.run(code, stdin=test["input"], timeout_s=self.judge.timeout_s)
                verdict = r.status
                if r.status == "ok":
                    verdict = "pass" if stdout_matches(r.stdout, test["output"]) else "wrong_answer"
                lines.append(f"example {i + 1}: {verdict}\ninput:\n{test['input']}\nyour output:\n{r.stdout}")
                if r.stderr:
                    lines.append(f"stderr:\n{r.stderr}")
        text = "\n".join(lines)
        return text if len(text) <= self.max_feedback_chars else text[: self.max_feedback_chars] + "\n[truncated]"

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.row is None:
            raise RuntimeError("Cannot call step() before reset()")
        self.turn += 1
        info: dict[str, Any] = {"role": "user", "turn": self.turn, "id": self.row["id"], "runs": self.runs}
        block = _last_block(action)
        last_turn = self.turn >= self.max_turns
        if block is not None and block[0].endswith("run") and not last_turn:
            if self.runs >= self.max_runs:
                return "No runs left: submit your solution in a plain ```python block.", 0.0, False, False, info
            self.runs += 1
            info["runs"] = self.runs
            return self._run_feedback(block[1]), 0.0, False, False, info
        if block is None:
            if last_turn:
                return "", 0.0, True, False, {**info, "passed": 0, "total": 0}
            return "No code block found. Put your solution in a ```python block.", 0.0, False, False, info
        result = self._judge(block[1])
        reward = result.fraction if self.partial_reward else float(result.all_passed)
        info.update(passed=result.passed, total=result.total, statuses=result.statuses)
        return "", reward, True, False, info
