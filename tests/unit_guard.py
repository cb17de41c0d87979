"""What keeps the ``unit`` tier true: while a unit test runs, starting a process (subprocess, fork, spawn,
multiprocessing), listening on a socket or importing Ray is a violation. Each raises where it happens and
is also recorded, so a test that catches the error still fails. Threads that a test outside the tier left
running (a process test's server) are not watched; those an earlier unit test left are."""

from __future__ import annotations

import importlib.abc
import multiprocessing.process
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

_UNIT_BORN: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # threads started within some unit_guard


class UnitTierViolation(AssertionError):
    """A unit test started a process, listened on a socket or imported Ray: mark it ``process``."""


_PROCESS_STARTERS = [
    (subprocess.Popen, "_execute_child", "starts a subprocess"),
    (multiprocessing.process.BaseProcess, "start", "starts a multiprocessing process"),
    (socket.socket, "listen", "listens on a socket (a server)"),
    (uvicorn.Server, "startup", "listens on a socket (a server: uvicorn, whose uvloop listens in C)"),
    *((os, name, f"calls os.{name}") for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")),
]


class _NoRay(importlib.abc.MetaPathFinder):
    def __init__(self, violate) -> None:
        self.violate = violate

    def find_spec(self, fullname, path, target=None):
        if fullname == "ray" or fullname.startswith("ray."):
            self.violate("imports ray")
        return None


@contextmanager
def unit_guard(violations: list[str]) -> Iterator[None]:
    """Within the block, a process start, a ``listen`` or ``import ray`` from a thread that no other tier
    started raises `UnitTierViolation` and appends its description to ``violations``."""
    older = set(threading.enumerate()) - set(_UNIT_BORN) - {threading.current_thread()}

    def violate(what: str) -> None:
        if threading.current_thread() in older:
            return
        violations.append(what)
        raise UnitTierViolation(f"a unit test {what}: mark it `process`")

    def guarded(original, what):
        def guard(*args, **kwargs):
            violate(what)
            return original(*args, **kwargs)

        return guard

    ray_loaded = "ray" in sys.modules
    present = [starter for starter in _PROCESS_STARTERS if hasattr(*starter[:2])]
    own = [(owner, name, vars(owner).get(name)) for owner, name, _ in present]  # None: inherited (socket.listen)
    for owner, name, what in present:
        setattr(owner, name, guarded(getattr(owner, name), what))
    finder = _NoRay(violate)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        _UNIT_BORN.update(set(threading.enumerate()) - older - {threading.current_thread()})
        sys.meta_path.remove(finder)
        for owner, name, original in own:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        if not ray_loaded and "ray" in sys.modules and "imports ray" not in violations:
            violations.append("imports ray")
