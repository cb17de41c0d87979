"""The evaluation harness: pass@k against its closed form, and exact avg@n / pass@k / maj@k on AIME 2024 and
a MATH-500 slice with a scripted engine that answers right for a known set of (problem, sample) pairs."""

import asyncio
import json
import math
import re
from pathlib import Path

import pytest

from areal_agents.data.builtin import BUILTIN
from areal_agents.engines.base import InferenceEngine
from areal_agents.eval.metrics import maj_at_k, pass_at_k, report_ks
from areal_agents.eval.runner import EvalSettings, evaluate_dataset
from areal_agents.types import GenResponse


def lines(name):
    """The lines (one JSON row each) of bundled set ``name``."""
    return BUILTIN[name].path().read_text().splitlines()


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 0, 1, 0.0),
        (4, 4, 1, 1.0),
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 1 - 1 / 6),  # 1 - C(2,2)/C(4,2)
        (10, 3, 5, 1 - math.comb(7, 5) / math.comb(10, 5)),
        (5, 3, 3, 1.0),  # fewer wrong samples than k: always a right one
    ],
)
def test_pass_at_k_closed_form(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_is_the_probability_over_all_draws():
    from itertools import combinations

    n, c = 6, 2
    for k in range(1, n + 1):
        draws = list(combinations([True] * c + [False] * (n - c), k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))


def test_maj_at_k_and_ks():
    assert maj_at_k(["7", "8", "8"], [True, False, False], 1) == 1.0
    assert maj_at_k(["7", "8", "8"], [True, False, False], 3) == 0.0
    assert maj_at_k(["7", "8"], [True, False], 2) == 1.0  # a tie goes to the earliest
    assert maj_at_k([None, None, "8"], [False, False, True], 3) == 1.0  # no answer, no vote
    assert report_ks(32) == [1, 2, 4, 8, 16, 32] and report_ks(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(4, 5, 1)


class GoldEngine(InferenceEngine):
    """Answers ``\\boxed{gold}`` for problem i, sample j when ``right(i, j)``, else the same wrong answer."""

    def __init__(self, tokenizer, golds, right, wrong="\\boxed{WRONG}"):
        self.tokenizer, self.golds, self.right, self.wrong = tokenizer, golds, right, wrong

    async def agenerate(self, request):
        i, j = map(int, re.match(r"p(\d+)/s(\d+)/", request.rid).groups())
        text = f"The answer is \\boxed{{{self.golds[i]}}}." if self.right(i, j) else self.wrong
        tokens = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return GenResponse(tokens, [-0.1] * len(tokens), [0] * len(tokens), "stop")


def run(tmp_path, tokenizer, dataset, golds, right, n, breakdown=(), num_problems=None):
    settings = EvalSettings(
        env_id="areal_agents/Math-v0",
        env_kwargs={"dataset": str(dataset), "split": "test"},
        n_samples=n,
        temperature=0.6,
        top_p=0.95,
        max_new_tokens=64,
        breakdown=breakdown,
        num_problems=num_problems,
    )
    engine = GoldEngine(tokenizer, golds, right)
    return asyncio.run(evaluate_dataset(settings, engine, tokenizer, tmp_path / "out", progress=False))


@pytest.mark.process
def test_aime24_metrics_are_exact(tmp_path, tokenizer):
    golds = [json.loads(line)["answer"] for line in lines("aime24")]
    assert len(golds) == 30

    def right(i, j):  # problems 0-9 always right, 10-19 right on sample 0 only, 20-29 never
        return i < 10 or (i < 20 and j == 0)

    summary = run(tmp_path, tokenizer, "aime24", golds, right, n=4)
    assert summary["problems"] == 30 and summary["samples"] == 120
    assert summary["avg@4"] == pytest.approx((10 + 10 * 0.25) / 30)
    assert summary["pass@1"] == pytest.approx((10 + 10 * 0.25) / 30)
    assert summary["pass@2"] == pytest.approx((10 + 10 * 0.5) / 30)
    assert summary["pass@4"] == pytest.approx(20 / 30)
    assert summary["maj@1"] == pytest.approx(20 / 30)
    assert summary["maj@2"] == pytest.approx(20 / 30)  # right vs wrong: the tie goes to sample 0
    assert summary["maj@4"] == pytest.approx(10 / 30)  # three identical wrong answers outvote it
    assert summary["truncation_rate"] == 0.0
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["index"] == 0 and r["sample"] == 0)
    assert first["problem_id"] == "2024-I-1" and first["answer"] == "204" and first["correct"]
    assert first["finish_reason"] == "stop" and first["tokens"] > 0


@pytest.mark.process
def test_math500_slice_with_latex_answers_and_breakdown(tmp_path, tokenizer):
    rows = [json.loads(line) for line in lines("math500")[:20]]
    sliced = tmp_path / "math500_slice.jsonl"
    sliced.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def right(i, j):
        return i % 2 == 0  # even problems right on both samples

    summary = run(tmp_path, tokenizer, sliced, [r["answer"] for r in rows], right, n=2, breakdown=("level",))
    assert summary["avg@2"] == pytest.approx(0.5) and summary["pass@2"] == pytest.approx(0.5)
    assert summary["maj@2"] == pytest.approx(0.5)
    levels = {str(r["level"]) for r in rows}
    assert set(summary["by_level"]) == levels
    assert sum(v["problems"] for v in summary["by_level"].values()) == 20


@pytest.mark.process
def test_an_interrupted_run_resumes_with_what_it_scored(tmp_path, tokenizer):
    golds = [json.loads(line)["answer"] for line in lines("aime24")]
    # an earlier run of the same settings scored (0, 0) as wrong (kept as is), then was cut mid-line
    run(tmp_path, tokenizer, "aime24", golds, lambda i, j: False, n=1, num_problems=1)
    with (tmp_path / "out" / "samples.jsonl").open("a") as f:
        f.write('{"problem_id": "2024-I-1", "ind')
    summary = run(tmp_path, tokenizer, "aime24", golds, lambda i, j: True, n=1)
    assert summary["samples"] == 30
    assert summary["avg@1"] == pytest.approx(29 / 30)  # the kept sample was not run again


@pytest.mark.process
def test_cli_eval_of_the_tiny_model_on_a_math500_slice(tmp_path, tiny_dir, capsys):
    from areal_agents.cli import main

    rows = lines("math500")[:50]
    sliced = tmp_path / "math500.jsonl"  # named like the preset: its sampling defaults and breakdown apply
    sliced.write_text("\n".join(rows) + "\n")
    out = tmp_path / "eval"
    args = ["eval", "--dataset", str(sliced), "--model", str(tiny_dir), "--n-samples", "2"]
    assert main([*args, "--max-new-tokens", "8", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "avg@2" in printed and "pass@2" in printed and "maj@2" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == 50 and summary["samples"] == 100 and summary["failed_samples"] == 0
    assert summary["settings"]["temperature"] == 0.6 and summary["settings"]["top_p"] == 0.95
    assert "by_level" in summary and summary["truncation_rate"] > 0  # 8 tokens: most answers are cut
    assert len((out / "samples.jsonl").read_text().splitlines()) == 100


def _code_judge_solutions():
    """The hand-written right and wrong solutions of the judge's tests (tests/rewards/test_code_judge.py)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "rewards" / "test_code_judge.py"
    spec = importlib.util.spec_from_file_location("code_judge_solutions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CORRECT, module.WRONG


class ScriptedCodeEngine(InferenceEngine):
    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply = tokenizer, reply

    async def agenerate(self, request):
        i, j = map(int, re.match(r"p(\d+)/s(\d+)/", request.rid).groups())
        tokens = self.tokenizer.encode(self.reply(i, j), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return GenResponse(tokens, [-0.1] * len(tokens), [0] * len(tokens), "stop")


@pytest.mark.process
def test_lcb_hidden_tests_through_the_sandbox(tmp_path, tokenizer):
    from areal_agents.eval.presets import PRESETS

    correct, wrong = _code_judge_solutions()
    qids = [json.loads(line)["question_id"] for line in lines("lcb_hidden3")]

    def reply(i, j):  # sample 0 right, sample 1 wrong, for every problem
        return f"```python\n{(correct if j == 0 else wrong)[qids[i]]}```"

    lcb = PRESETS["lcb"]
    settings = EvalSettings(
        env_id=lcb.env_id,
        env_kwargs={**lcb.env_kwargs, "dataset": "lcb_hidden3"},
        n_samples=2,
        temperature=0.6,
        top_p=0.95,
        max_new_tokens=512,
    )
    engine = ScriptedCodeEngine(tokenizer, reply)
    summary = asyncio.run(evaluate_dataset(settings, engine, tokenizer, tmp_path / "lcb", progress=False))
    assert summary["problems"] == 3 and summary["failed_samples"] == 0
    assert summary["pass@1"] == pytest.approx(0.5) and summary["pass@2"] == pytest.approx(1.0)
    assert "maj@1" not in summary  # code has no answer to vote on


@pytest.mark.process
def test_lcb_date_window_filters_problems(tmp_path, tokenizer):
    rows = [json.loads(line) for line in lines("lcb_v5_subset")]
    window = ("2024-09-01", "2024-10-01")
    inside = sum(window[0] <= r["contest_date"][:10] < window[1] for r in rows)
    assert 0 < inside < len(rows)
    settings = EvalSettings(
        env_id="areal_agents/Code-v0",
        env_kwargs={"dataset": "lcb_v5_subset", "max_turns": 1, "max_runs": 0},
        n_samples=1,
        temperature=0.6,
        top_p=0.95,
        max_new_tokens=64,
        date_range=window,
    )
    engine = ScriptedCodeEngine(tokenizer, lambda i, j: "```python\nprint(0)\n```")
    summary = asyncio.run(evaluate_dataset(settings, engine, tokenizer, tmp_path / "lcb", progress=False))
    assert summary["problems"] == inside and summary["pass@1"] == 0.0


def test_eval_report_compares_runs(tmp_path, capsys):
    from areal_agents.cli import main

    for name, acc in (("base", 0.25), ("rl", 0.5)):
        (tmp_path / name).mkdir()
        summary = {"problems": 30, "avg@4": acc, "pass@4": acc + 0.1, "mean_tokens": 100.0, "truncation_rate": 0.1}
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    assert main(["eval-report", str(tmp_path / "base"), str(tmp_path / "rl")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["metric", "base", "rl"]
    assert lines[1].split() == ["avg@4", "25.0%", "50.0%"] and lines[2].split() == ["pass@4", "35.0%", "60.0%"]
    assert main(["eval-report", str(tmp_path / "missing")]) == 2


# Hand-written solutions to four lcb_v5_subset problems (by row index), right and subtly wrong.
LCB_SUBSET_RIGHT = {
    0: "y = int(input())\nprint(366 if (y % 4 == 0 and y % 100 != 0) or y % 400 == 0 else 365)\n",
    21: "class Solution:\n    def finalPositionOfSnake(self, n: int, commands: List[str]) -> int:\n"
    "        i = j = 0\n        for c in commands:\n"
    "            di, dj = {'UP': (-1, 0), 'DOWN': (1, 0), 'LEFT': (0, -1), 'RIGHT': (0, 1)}[c]\n"
    "            i, j = i + di, j + dj\n        return i * n + j\n",
    22: "class Solution:\n    def countKConstraintSubstrings(self, s: str, k: int) -> int:\n"
    "        return sum(1 for a in range(len(s)) for b in range(a + 1, len(s) + 1)\n"
    "                   if s[a:b].count('0') <= k or s[a:b].count('1') <= k)\n",
    24: "class Solution:\n    def checkTwoChessboards(self, coordinate1: str, coordinate2: str) -> bool:\n"
    "        color = lambda c: (ord(c[0]) + int(c[1])) % 2\n        return color(coordinate1) == color(coordinate2)\n",
}
LCB_SUBSET_WRONG = {
    0: LCB_SUBSET_RIGHT[0].replace("or y % 400 == 0", ""),
    21: LCB_SUBSET_RIGHT[21].replace("i * n + j", "j * n + i"),
    22: LCB_SUBSET_RIGHT[22].replace("<= k or", "<= k and"),
    24: LCB_SUBSET_RIGHT[24].replace("==", "!="),
}


@pytest.mark.process
def test_lcb_subset_right_and_wrong_solutions(tmp_path, tokenizer):
    def reply(i, j):  # four problems: right on sample 0, wrong on sample 1; the rest: a wrong program
        code = (LCB_SUBSET_RIGHT if j == 0 else LCB_SUBSET_WRONG).get(i, "print(0)\n")
        return f"```python\n{code}```"

    settings = EvalSettings(
        env_id="areal_agents/Code-v0",
        env_kwargs={"dataset": "lcb_v5_subset", "max_turns": 1, "max_runs": 0},
        n_samples=2,
        temperature=0.6,
        top_p=0.95,
        max_new_tokens=1024,
    )
    summary = asyncio.run(
        evaluate_dataset(settings, ScriptedCodeEngine(tokenizer, reply), tokenizer, tmp_path / "lcb", progress=False)
    )
    assert summary["problems"] == 40 and summary["failed_samples"] == 0
    assert summary["avg@2"] == pytest.approx(4 * 0.5 / 40) and summary["pass@2"] == pytest.approx(4 / 40)
    rows = [json.loads(line) for line in (tmp_path / "lcb" / "samples.jsonl").read_text().splitlines()]
    assert {r["index"] for r in rows if r["correct"]} == set(LCB_SUBSET_RIGHT)


@pytest.mark.process
def test_eval_config_file_and_its_errors(tmp_path, tiny_dir):
    from areal_agents.cli import main

    rows = lines("aime24")[:3]
    sliced = tmp_path / "three.jsonl"
    sliced.write_text("\n".join(rows) + "\n")
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"dataset: {sliced}\nmodel: {tiny_dir}\nn_samples: 2\nmax_new_tokens: 4\ntemperature: 1.0\n"
        f"out: {tmp_path / 'o'}\n"
    )
    assert main(["eval", "--config", str(config), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["samples"] == 6 and summary["settings"]["temperature"] == 1.0
    config.write_text("datasett: x\n")
    assert main(["eval", "--config", str(config)]) == 2
    assert main(["eval", "--model", str(tiny_dir)]) == 2  # no dataset: a one-line error
