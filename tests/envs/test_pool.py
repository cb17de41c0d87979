import asyncio
import math

import pytest

import areal_agents.envs.testing  # noqa: F401  (registers the testing ids)
from areal_agents.envs.runtime.pool import LocalEnvPool
from areal_agents.errors import EnvError
from areal_agents.workers import CallTimeout, RemoteError, WorkerDied, WorkerPool

FAULTY = "areal_agents_testing/Faulty-v0"
PROCESS = pytest.param("process", marks=pytest.mark.process)


async def episode(pool, action, seed=0):
    env = pool.make(FAULTY)
    await env.areset(seed=seed)
    try:
        return await env.astep(action)
    finally:
        await env.aclose()


@pytest.mark.parametrize("mode", ["inline", "thread", PROCESS])
def test_modes_agree_with_the_plain_env(mode):
    from areal_agents.envs import make_env

    plain = make_env("areal_agents/Arithmetic-v0", max_turns=2)
    expected = (plain.reset(seed=5), plain.step("0"))

    async def run():
        pool = LocalEnvPool(mode, workers=2, step_timeout=10)
        try:
            env = pool.make("areal_agents/Arithmetic-v0", max_turns=2)
            return await env.areset(seed=5), await env.astep("0")
        finally:
            await pool.aclose()

    assert run_sync(run()) == expected


def run_sync(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("mode", ["thread", PROCESS])
def test_env_exception_is_a_typed_env_error_and_others_carry_on(mode):
    async def run():
        pool = LocalEnvPool(mode, workers=2, step_timeout=10)
        try:
            results = await asyncio.gather(episode(pool, "raise"), episode(pool, "hi"), return_exceptions=True)
        finally:
            await pool.aclose()
        return results

    bad, good = run_sync(run())
    assert isinstance(bad, EnvError) and bad.kind == "env_error" and "injected env failure" in str(bad)
    assert good[1] == 1.0


@pytest.mark.parametrize("mode", ["thread", PROCESS])
def test_hang_past_timeout_is_a_timeout(mode):
    async def run():
        pool = LocalEnvPool(mode, workers=2, step_timeout=0.5)  # cold workers: start-up is not call time
        try:
            return await asyncio.gather(episode(pool, "hang"), episode(pool, "hi"), return_exceptions=True)
        finally:
            await pool.aclose()

    hung, good = run_sync(run())
    assert isinstance(hung, EnvError) and hung.kind == "timeout"
    assert good[1] == 1.0


@pytest.mark.process
def test_dead_worker_fails_only_its_episode():
    async def run():
        pool = LocalEnvPool("process", workers=2, step_timeout=10)
        try:
            results = await asyncio.gather(episode(pool, "die"), episode(pool, "hi"), return_exceptions=True)
            after = await episode(pool, "hi")  # the pool replaced the worker and keeps serving
        finally:
            await pool.aclose()
        return results, after

    (died, good), after = run_sync(run())
    assert isinstance(died, EnvError) and died.kind == "worker_died"
    assert good[1] == 1.0 and after[1] == 1.0


@pytest.mark.process
def test_worker_pool_errors_are_typed():
    async def run():
        pool = WorkerPool(workers=1)
        try:
            assert await pool.call(math.factorial, 5) == 120
            with pytest.raises(RemoteError, match="ValueError"):
                await pool.call(math.factorial, -1)
            with pytest.raises(CallTimeout):
                await pool.call(__import__("time").sleep, 5, timeout=0.2)
            import os

            with pytest.raises(WorkerDied):
                await pool.call(os._exit, 3)
            assert await pool.call(math.factorial, 4) == 24
            return pool.stats
        finally:
            pool.close()

    stats = run_sync(run())
    assert (stats.timeouts, stats.deaths, stats.errors, stats.restarts) == (1, 1, 1, 2)


def test_envs_of_clean_sessions_are_reused_broken_ones_are_not():
    async def run():
        pool = LocalEnvPool("inline")
        try:
            first = pool.make(FAULTY)
            await first.areset(seed=0)
            await first.astep("hi")
            env = first.env
            await first.aclose()
            again = pool.make(FAULTY)
            other_kwargs = pool.make(FAULTY, max_turns=5)
            reused = again.env is env and other_kwargs.env is not env
            assert (await again.areset(seed=0))[0] == (await first_reset(pool))[0]  # reset starts afresh
            try:
                await again.astep("raise")
            except EnvError:
                pass
            await again.aclose()
            fresh = pool.make(FAULTY)
            return reused, fresh.env is not env
        finally:
            await pool.aclose()

    async def first_reset(pool):
        env = pool.make(FAULTY)
        try:
            return await env.areset(seed=0)
        finally:
            await env.aclose()

    assert run_sync(run()) == (True, True)


@pytest.mark.slow
def test_a_process_pool_refuses_an_env_defined_in_main():
    import gymnasium as gym

    from areal_agents.envs.testing import EchoEnv
    from areal_agents.workers import WorkerImportError

    in_main = type("ScriptEnv", (EchoEnv,), {"__module__": "__main__"})  # as a user's script defines it
    gym.register(id="areal_agents_testing/ScriptEnv-v0", entry_point=in_main)
    pool = LocalEnvPool("process", workers=1)
    try:  # its workers never import __main__: refused at make, before any episode, with the fix named
        with pytest.raises(WorkerImportError, match="class ScriptEnv is defined in __main__.*in a module"):
            pool.make("areal_agents_testing/ScriptEnv-v0")
    finally:
        run_sync(pool.aclose())
        del gym.registry["areal_agents_testing/ScriptEnv-v0"]


@pytest.mark.process
def test_env_threads_and_workers_compute_with_one_intra_op_thread():
    import torch

    pool = LocalEnvPool("thread", workers=1)
    try:  # a thread that never set its count would take the last one any thread set (here 2)
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        assert pool.threads.submit(torch.get_num_threads).result() == 1
        torch.set_num_threads(before)
    finally:
        run_sync(pool.aclose())
    pool = LocalEnvPool("process", workers=1)
    try:
        assert pool.workers.threads == 1  # set in each worker before its imports (tests/test_workers.py)
    finally:
        run_sync(pool.aclose())
