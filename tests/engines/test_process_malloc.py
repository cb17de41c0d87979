"""An engine process's malloc keeps what it frees (`keep_freed_memory`): a thread allocating and freeing
tensors of tens of MB takes no new page faults, where glibc's own policy faults on every allocation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from areal_agents.engines.process_malloc import MALLOC_ENV, keep_freed_memory
from areal_agents.errors import ConfigError

# a thread (as the engine's decode thread) allocates and frees 64 MB tensors; prints the policy and its faults
CHURN = """
import resource, threading
from areal_agents.engines.process_malloc import keep_freed_memory
kept = keep_freed_memory()
import torch

def churn(out):
    for _ in range(3):
        torch.ones(16 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.ones(16 << 20)
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

out = []
thread = threading.Thread(target=churn, args=(out,))
thread.start()
thread.join()
print(kept, out[0])
"""


def _churn(policy: str) -> tuple[str, int]:
    env = {**os.environ, MALLOC_ENV: policy}
    env.pop("GLIBC_TUNABLES", None)
    done = subprocess.run([sys.executable, "-c", CHURN], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    kept, faults = done.stdout.split()
    return kept, int(faults)


@pytest.mark.process
def test_a_thread_reuses_freed_memory_without_page_faults_where_glibc_faults_every_time() -> None:
    kept, faults = _churn("keep")
    unchanged, system_faults = _churn("system")
    assert (kept, unchanged) == ("True", "False")
    assert system_faults > 20 * (16 << 20) * 4 // 4096 // 2  # most of every allocation's pages fault again
    assert faults < system_faults // 50


def test_a_bad_policy_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MALLOC_ENV, "tcmalloc")
    with pytest.raises(ConfigError, match=f"{MALLOC_ENV}: expects 'keep' or 'system', got 'tcmalloc'"):
        keep_freed_memory()


def test_malloc_tunables_the_user_set_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert keep_freed_memory() is False
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv(MALLOC_ENV, "system")
    assert keep_freed_memory() is False
