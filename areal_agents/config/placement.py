"""The cores this process may use, and the intra-op threads a part of the run takes of them (``auto``: 0).

A run's parts share the cores on purpose: the event loop (agents, envs: Python), the engine's decode
thread and the trainer each drive an OpenMP team of their own (torch's intra-op threads belong to the
thread that sets them). A team splits every parallel region evenly and waits for its slowest thread, so a
team wider than the cores left to it waits, region after region, for a thread that lost its core: 15
steps of the arithmetic recipe took 62 s of updates with a 2-thread team on 2 cores beside other work,
against 8 s on one thread (docs/benchmarks.md, "Threads"). So an ``auto`` team leaves one core to the
event loop, which also absorbs one core that something else keeps busy.

    usable_cores()          # 2 on a 2-core machine; fewer under taskset, a cpuset or a CPU quota
    team_threads()          # 1 there: the cores less the event loop's
    team_threads(sharers=2) # each of two teams that compute at the same time
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (taskset, a container's cpuset), capped by a cgroup
    v2 CPU quota (``docker --cpus``) when one is set."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _cgroup_quota() -> float | None:
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def team_threads(sharers: int = 1, cores: int | None = None) -> int:
    """Intra-op threads of each of ``sharers`` teams that compute at the same time: ``cores`` (default
    `usable_cores`) less one for the run's event loop, shared out; at least 1, and at most
    ``OMP_NUM_THREADS`` when that is set (the user's word for the whole process)."""
    cores = usable_cores() if cores is None else cores
    threads = max(1, (cores - 1) // max(1, sharers))
    return min(threads, _omp_limit() or threads)


def _omp_limit() -> int | None:
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"].split(",")[0]))
    except (KeyError, ValueError):
        return None
