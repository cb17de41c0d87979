"""`WorkerPool` and `spawn_child`: workers never import the caller's ``__main__``; what they cannot run is a clear
error (`WorkerImportError`, `WorkerStartError`), never a result; `shared_pool` is one per purpose."""

import functools
import importlib
import operator
import os
import sys
import types
from multiprocessing import resource_tracker, spawn

import pytest

from areal_agents import workers
from areal_agents.workers import (
    WorkerImportError,
    WorkerPool,
    WorkerStartError,
    may_start_processes,
    shared_pool,
    start_child,
)


@pytest.mark.process
def test_a_shared_pool_is_one_per_name_and_new_after_a_fork():
    first = shared_pool("test-shared", 1)
    other = shared_pool("test-other", 1)
    try:
        assert shared_pool("test-shared", 1) is first and other is not first
        assert first.call_sync(operator.add, 2, 3, timeout=60) == 5
        workers._shared["test-shared"] = (os.getpid() - 1, first)  # as a forked child sees its parent's pool
        child = shared_pool("test-shared", 1)
        assert child is not first and shared_pool("test-shared", 1) is child
        child.close()
    finally:
        first.close()
        other.close()
        workers._shared.pop("test-shared", None)
        workers._shared.pop("test-other", None)


def test_the_main_process_may_start_workers():
    assert may_start_processes()


def in_main(completion: str, row: dict) -> float:
    return 1.0


in_main.__module__ = "__main__"  # as a user's script defines it
InMain = type("InMain", (), {"__module__": "__main__", "__call__": lambda self, c, r: 1.0})


@pytest.fixture(scope="module")
def pool():
    pool = WorkerPool(1, name="test-pool")
    yield pool
    pool.close()


@pytest.mark.slow
def test_a_function_or_class_of_main_is_refused_by_name_before_it_is_sent(pool, monkeypatch):
    monkeypatch.setattr(sys.modules["__main__"], "in_main", in_main, raising=False)  # so pickle finds them
    monkeypatch.setattr(sys.modules["__main__"], "InMain", InMain, raising=False)
    with pytest.raises(WorkerImportError, match=r"function 'in_main' is defined in __main__.*define it in a module"):
        pool.call_sync(operator.call, in_main, "x", {})
    with pytest.raises(WorkerImportError, match=r"class 'InMain' is defined in __main__"):
        pool.call_sync(operator.call, [InMain()], timeout=60)
    assert pool.call_sync(str.upper, "__main__", timeout=60) == "__MAIN__"  # the word as data is no reference
    assert pool.stats.calls == 3 and pool.stats.errors == 0


@pytest.mark.slow
def test_a_call_the_worker_cannot_import_is_refused_and_the_worker_serves_on(pool):
    ghost = types.ModuleType("ghost_module_of_the_parent")  # importable here only
    exec("def f(x):\n    return x", ghost.__dict__)
    sys.modules[ghost.__name__] = ghost
    try:
        with pytest.raises(WorkerImportError, match=r"could not load the call to f: ModuleNotFoundError.*ghost_module"):
            pool.call_sync(ghost.f, 1, timeout=60)
    finally:
        del sys.modules[ghost.__name__]
    assert pool.call_sync(operator.add, 1, 2, timeout=60) == 3 and pool.stats.deaths == 0


@pytest.mark.slow
def test_a_worker_whose_initializer_fails_is_a_start_error_at_each_call():
    pool = WorkerPool(1, initializer=functools.partial(importlib.import_module, "no_such_module_for_workers"))
    try:
        for _ in range(2):  # the replacement fails the same way: raised again, never a result
            with pytest.raises(WorkerStartError, match=r"(?s)could not start: its initializer raised.*no_such_module"):
                pool.call_sync(operator.add, 1, 2, timeout=60)
        assert pool.stats.start_failures == 2 and pool.stats.errors == 0
    finally:
        pool.close()


@pytest.fixture
def interpreter():
    """Set the interpreter workers are started with; the real one is put back after the test."""
    real = spawn.get_executable()
    resource_tracker.ensure_running()  # started by the real interpreter: it is shared, not a worker
    yield spawn.set_executable
    spawn.set_executable(os.fsdecode(real))


def test_a_missing_interpreter_is_a_start_error_naming_it(interpreter):
    interpreter("/nonexistent/python3")
    with pytest.raises(WorkerStartError, match=r"'test-pool': no executable interpreter at /nonexistent/python3"):
        WorkerPool(1, name="test-pool")


@pytest.mark.slow
def test_an_interpreter_that_exits_at_once_is_a_start_error(interpreter):
    interpreter("/bin/false")
    try:  # it exits before or after taking its start-up data: refused at start or at the first call
        pool = WorkerPool(1, name="test-pool")
    except WorkerStartError as e:
        assert "could not start process 'test-pool' with /bin/false" in str(e)
        return
    try:
        with pytest.raises(WorkerStartError, match=r"test-pool worker process \(/bin/false\) could not start"):
            pool.call_sync(operator.add, 1, 2, timeout=60)
    finally:
        pool.close()


class Refused(Exception):
    pass


@pytest.mark.process
def test_start_child_refuses_main_targets_and_names_start_failures(interpreter):
    target = types.FunctionType(in_main.__code__, {}, "serve")
    target.__module__, target.__qualname__ = "__main__", "serve"
    with pytest.raises(WorkerImportError, match="function 'serve' is defined in __main__"):
        start_child(target, (), "child", Refused, "could not start the child")
    interpreter("/nonexistent/python3")
    with pytest.raises(Refused, match=r"could not start the child: .*no executable interpreter at /nonexistent"):
        start_child(operator.add, (), "child", Refused, "could not start the child")


def _torch_threads() -> tuple[str | None, int]:
    import torch  # noqa: PLC0415  (loaded in the worker after its start: it reads OMP_NUM_THREADS)

    return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


@pytest.mark.process
def test_workers_take_the_intra_op_threads_they_are_given():
    pool = WorkerPool(1, name="test-threads", threads=1)
    try:
        assert pool.call_sync(_torch_threads, timeout=120) == ("1", 1)
    finally:
        pool.close()
    with pytest.raises(ValueError, match="threads >= 1"):
        WorkerPool(1, threads=0)
