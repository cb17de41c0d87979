"""A score is never wrong because a worker failed: a worker that cannot start raises `WorkerStartError`, a
worker killed from outside is replaced and the call tried again, and a reward defined in ``__main__`` (which
workers never import) is refused by name."""

import asyncio
import functools
import importlib
import operator
import os
import signal
import sys
from multiprocessing import resource_tracker, spawn

import pytest
from user_plugins import DiesOnce

from areal_agents import workers
from areal_agents.rewards.math_reward import MathReward
from areal_agents.rewards.math_verifier import check_math
from areal_agents.rewards.service import RewardService
from areal_agents.workers import WorkerImportError, WorkerPool, WorkerStartError

LATEX = ("so it is $\\boxed{\\frac{\\sqrt{2}}{2}}$", "\\frac{1}{\\sqrt{2}}")  # math-verify's, in its pool


@pytest.fixture
def own_verification_pool():
    """Lets a test put its own pool in place of math-verify's process-wide one; the old one comes back."""
    old = workers._shared.pop("math-verify", None)
    yield
    _, pool = workers._shared.pop("math-verify", (0, None))
    if pool is not None:
        pool.close()
    if old is not None:
        workers._shared["math-verify"] = old


@pytest.mark.slow
def test_verify_math_raises_when_its_workers_cannot_start(own_verification_pool):
    real = spawn.get_executable()
    resource_tracker.ensure_running()  # started by the real interpreter: it is shared, not a worker
    spawn.set_executable("/bin/false")
    try:
        with pytest.raises(WorkerStartError, match="math-verify"):
            check_math(*LATEX)  # never MathCheck(False, ...)
    finally:
        spawn.set_executable(os.fsdecode(real))


@pytest.mark.slow
def test_a_verification_worker_killed_from_outside_costs_no_score(own_verification_pool):
    pool = WorkerPool(1)
    workers._shared["math-verify"] = (os.getpid(), pool)
    assert pool.call_sync(operator.add, 1, 1, timeout=120) == 2  # started and ready
    os.kill(pool.pids[0], signal.SIGKILL)  # an OOM kill, say
    check = check_math(*LATEX)
    assert (check.correct, check.method) == (True, "math_verify") and pool.stats.deaths == 1


def in_main(completion, row):
    return 1.0


in_main.__module__ = "__main__"  # as a user's script defines it


@pytest.fixture(scope="module")
def service():
    service = RewardService(workers=1, timeout=60)
    yield service
    asyncio.run(service.aclose())


@pytest.mark.slow
def test_a_reward_whose_worker_was_killed_is_scored_again(service, tmp_path):
    result = asyncio.run(service.score(DiesOnce(str(tmp_path / "died")), "x", {}))
    assert result.reward == 1.0 and (tmp_path / "died").exists()
    assert service.metrics()["errors"] == 0 and service.pool.stats.deaths == 1


@pytest.mark.slow
def test_a_reward_defined_in_main_is_refused_by_name(service, monkeypatch):
    monkeypatch.setattr(sys.modules["__main__"], "in_main", in_main, raising=False)
    calls = service.metrics()["calls"]
    with pytest.raises(WorkerImportError, match=r"function 'in_main' is defined in __main__.*define it in a module"):
        asyncio.run(service.score_batch(in_main, [("x", {}), ("y", {})]))
    assert service.metrics()["calls"] == calls  # nothing scored


@pytest.mark.slow
def test_a_reward_service_whose_workers_cannot_start_raises():
    failing = functools.partial(importlib.import_module, "no_such_module_for_rewards")
    service = RewardService(workers=1, timeout=60, initializer=failing)
    try:
        with pytest.raises(WorkerStartError, match="(?s)reward-service worker.*no_such_module_for_rewards"):
            asyncio.run(service.score_batch(MathReward(), [("\\boxed{1}", {"answer": "1"})] * 3))
    finally:
        asyncio.run(service.aclose())


@pytest.mark.slow
def test_a_math_env_whose_reward_worker_died_scores_the_answer_again(tmp_path):
    import gymnasium as gym

    import areal_agents  # noqa: F401  (registers Math-v0)

    env = gym.make("areal_agents/Math-v0").unwrapped
    env.reset(seed=0)
    env.reward_fn = DiesOnce(str(tmp_path / "died"))  # its first worker dies under it: no fault of the answer
    _, reward, terminated, _, info = env.step("42")
    assert (reward, terminated) == (1.0, True) and "error" not in info and (tmp_path / "died").exists()
