"""Count host syncs on the CPU: the tensor reads that on CUDA wait for the device (``.item()``, ``.tolist()``,
``float(t)``, ``int(t)``, ``bool(t)``, ``.nonzero()`` and boolean-mask indexing, whose size is data). On the CPU
they cost nothing, so a test counts them instead of timing them:

    with count_host_syncs() as syncs:
        accumulate(...)
    assert syncs.total <= 1, syncs.calls
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

_READS = ("item", "tolist", "__float__", "__int__", "__index__", "__bool__", "nonzero")


@dataclass
class HostSyncs:
    calls: Counter = field(default_factory=Counter)  # (kind, the caller's file:line) -> count

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def record(self, kind: str) -> None:
        frame = traceback.extract_stack(limit=3)[0]  # the caller of the patched method
        self.calls[(kind, f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}")] += 1


def _counting(syncs: HostSyncs, kind: str, method):
    def read(self, *args, **kwargs):
        syncs.record(kind)
        return method(self, *args, **kwargs)

    return read


def _counting_getitem(syncs: HostSyncs, method):
    def getitem(self, index):
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            syncs.record("bool index")
        return method(self, index)

    return getitem


@contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """`HostSyncs` of everything run within (any thread: the patches are on ``torch.Tensor``)."""
    syncs = HostSyncs()
    saved = {name: torch.Tensor.__dict__.get(name) for name in (*_READS, "__getitem__")}
    try:
        for name in _READS:
            setattr(torch.Tensor, name, _counting(syncs, name.strip("_"), getattr(torch.Tensor, name)))
        torch.Tensor.__getitem__ = _counting_getitem(syncs, torch.Tensor.__getitem__)
        yield syncs
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
