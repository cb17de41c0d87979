"""`shared_pool`: one process-wide worker pool per purpose, started again in a forked child."""

import operator
import os

from areal_agents import workers
from areal_agents.workers import may_start_processes, shared_pool


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
