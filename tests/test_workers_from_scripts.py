"""Worker processes never run the user's program again: a plain script without a main guard, ``python -`` from
stdin and ``python -c`` get the answers a guarded script gets, from verify_math's pool, the reward service and
a process env pool, and gymnasium's ``check_env`` passes on Math-v0 and Code-v0 from an unguarded script.
(``python -c`` stands in for a Jupyter kernel, whose ``__main__`` is likewise no file: ipykernel is not
installed here.)"""

import json
import os
import subprocess
import sys

import pytest

# (completion, gold, correct): the fast path and math-verify's (in its pool), right and wrong
CASES = [
    ("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5", True),
    ("$\\boxed{\\sqrt{2}}$", "\\sqrt{2}", True),
    ("$\\boxed{x^2+1}$", "1+x^2", True),
    ("$\\boxed{\\pi/2}$", "\\frac{\\pi}{2}", True),
    ("$\\boxed{3}$", "\\sqrt{9}", True),
    ("$\\boxed{\\{1,2\\}}$", "\\{2,1\\}", True),
    ("$\\boxed{2x}$", "x+x", True),
    ("$\\boxed{\\sqrt{3}}$", "\\sqrt{2}", False),
    ("The answer is 42.", "42", True),
    ("$\\boxed{41}$", "42", False),
    ("$\\boxed{(1,2]}$", "(1,2]", True),
    ("$\\boxed{\\frac{\\sqrt{3}}{2}}$", "\\frac{1}{2}", False),
]

PROGRAM = """
import asyncio, json, os
print("PROGRAM-RAN", flush=True)  # once per run: a worker that ran the program again prints it too

from areal_agents.envs.runtime.pool import LocalEnvPool
from areal_agents.rewards.math_reward import MathReward
from areal_agents.rewards.math_verifier import verify_math
from areal_agents.rewards.service import RewardService
import my_rewards  # a module next to the program: what workers can import

CASES = json.loads(os.environ["CASES"])


def in_main(completion, row):  # workers cannot import this one
    return 1.0


async def rewards():
    service = RewardService(workers=2, timeout=120)
    try:
        rows = [(c, {"answer": g}) for c, g, _ in CASES]
        math = [r.reward for r in await service.score_batch(MathReward(), rows)]
        mine = [r.reward for r in await service.score_batch(my_rewards.exact, [("a", {"answer": "a"}), ("b", {})])]
        try:
            await service.score(in_main, "x", {})
            refused = None
        except Exception as e:  # WorkerImportError
            refused = f"{type(e).__name__}: {e}"
        return math, mine, refused
    finally:
        await service.aclose()


async def env():
    pool = LocalEnvPool("process", workers=1, step_timeout=120)
    try:
        session = pool.make("areal_agents/Arithmetic-v0", max_turns=1)
        obs, _ = await session.areset(seed=7)
        return obs, (await session.astep("0"))[1]
    finally:
        await pool.aclose()


def main():
    verdicts = [verify_math(c, g) for c, g, _ in CASES]
    math, mine, refused = asyncio.run(rewards())
    print("RESULT", json.dumps({"verdicts": verdicts, "math": math, "mine": mine, "refused": refused,
                                "env": asyncio.run(env())}), flush=True)
"""

MY_REWARDS = """
def exact(completion, row):
    return float(completion == row.get("answer"))
"""


def _run(args, tmp_path, stdin=None):
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    env = {**os.environ, "CASES": json.dumps(CASES), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, *args], input=stdin, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _expected():
    from areal_agents.envs import make_env

    plain = make_env("areal_agents/Arithmetic-v0", max_turns=1)
    obs, _ = plain.reset(seed=7)
    return obs, plain.step("0")[1]


UNGUARDED = PROGRAM + "\nmain()\n"
GUARDED = PROGRAM + '\nif __name__ == "__main__":\n    main()\n'


@pytest.mark.slow
@pytest.mark.parametrize("how", ["guarded script", "unguarded script", "stdin", "-c"])
def test_a_program_gets_the_same_answers_however_it_is_run(how, tmp_path):
    code = GUARDED if how == "guarded script" else UNGUARDED
    if how.endswith("script"):
        (tmp_path / "program.py").write_text(code)
        out = _run(["program.py"], tmp_path)
    else:
        out = _run(["-"], tmp_path, stdin=code) if how == "stdin" else _run(["-c", code], tmp_path)
    assert out.count("PROGRAM-RAN") == 1, out
    result = json.loads(out.split("RESULT ", 1)[1])
    truth = [correct for _, _, correct in CASES]
    assert result["verdicts"] == truth and result["math"] == [float(t) for t in truth]
    assert result["mine"] == [1.0, 0.0]
    assert "WorkerImportError: function 'in_main' is defined in __main__" in result["refused"]
    assert tuple(result["env"]) == _expected()


CHECK_ENV = """
print("PROGRAM-RAN", flush=True)
import gymnasium
from gymnasium.utils.env_checker import check_env
import areal_agents

for env_id in ("areal_agents/Math-v0", "areal_agents/Code-v0"):
    env = gymnasium.make(env_id)
    check_env(env.unwrapped)
    print("CHECKED", env_id, flush=True)
math = gymnasium.make("areal_agents/Math-v0")
math.reset(seed=0)
answer = math.unwrapped.row["answer"]
print("REWARDS", math.step(f"\\\\boxed{{{answer}}}")[1], flush=True)
"""


@pytest.mark.slow
def test_check_env_passes_on_math_and_code_from_an_unguarded_script(tmp_path):
    (tmp_path / "check.py").write_text(CHECK_ENV)
    out = _run(["check.py"], tmp_path)
    assert out.count("PROGRAM-RAN") == 1, out
    assert "CHECKED areal_agents/Math-v0" in out and "CHECKED areal_agents/Code-v0" in out
    assert "REWARDS 1.0" in out


@pytest.mark.slow
def test_training_from_an_unguarded_script_with_engine_and_trainer_processes_runs_it_once(tmp_path, tiny_dir):
    from test_cli import write_configs

    _, rl = write_configs(tmp_path, tiny_dir)
    args = ["train", str(rl), "rollout.max_staleness=1", "engine.own_process=true", "ppo.trainer=process"]
    program = f"""
print("PROGRAM-RAN", flush=True)
from areal_agents.cli import main
print("EXIT", main({[*args, "--no-progress"]!r}), flush=True)
"""
    (tmp_path / "train.py").write_text(program)
    out = _run(["train.py"], tmp_path)
    assert out.count("PROGRAM-RAN") == 1 and "EXIT 0" in out, out
    assert json.loads((tmp_path / "rl" / "summary.json").read_text())["engine_version"] == 2
