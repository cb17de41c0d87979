"""`keep_freed_memory`: an engine process's malloc keeps the memory it frees, instead of handing it back.

Each engine step allocates and frees tensors of megabytes (activations, keys and values, prefix-cache
blocks). glibc serves such sizes from fresh mappings or per-thread heaps and returns them to the kernel
when freed, so every step paid page faults again: serving 256 four-turn episodes at hidden 512 took 1.4M
faults a round and ~10% of the engine's time in the kernel (`bench/engine_vs_vllm.py`). vLLM's CPU workers
preload tcmalloc for the same reason; this asks glibc itself (`mallopt`): every thread in the main heap
(``M_ARENA_MAX=1``), no mapping per allocation (``M_MMAP_MAX=0``), a free top never trimmed
(``M_TRIM_THRESHOLD``). The price is resident memory: the process keeps its peak (fragmentation included).

It must run before the process starts threads (a thread that allocated keeps its own heap), so the engine's
processes call it first thing: serve-model and `ProcessEngine`'s child. It leaves alone a process whose
``GLIBC_TUNABLES`` sets malloc already, one whose ``AREAL_ENGINE_MALLOC`` is ``system``, and a C library
without glibc's `mallopt`.

    keep_freed_memory()   # True when it changed the policy
"""

from __future__ import annotations

import ctypes
import os

from areal_agents.errors import ConfigError

MALLOC_ENV = "AREAL_ENGINE_MALLOC"  # "keep" (the default) or "system": glibc's own policy
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's malloc.h
KEEP = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))


def keep_freed_memory() -> bool:
    """Set this process's glibc malloc to keep freed memory for reuse; False where it leaves it alone."""
    choice = os.environ.get(MALLOC_ENV, "keep")
    if choice not in ("keep", "system"):
        raise ConfigError(f"{MALLOC_ENV}: expects 'keep' or 'system', got {choice!r}")
    if choice == "system" or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = _glibc()
    if libc is None:
        return False
    return all(libc.mallopt(option, value) == 1 for option, value in KEEP)


def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (musl and macOS have no such `mallopt` options): the symbols
    the process has loaded already (`ctypes.util.find_library` would run ldconfig in a subprocess)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None
