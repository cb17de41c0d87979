"""The process group of a weight broadcast and its buckets: what the trainer's `BroadcastSync` and
serve-model's ``/init_weights_update_group`` and ``/update_weights_from_distributed`` share.

The group lives outside torch.distributed's registry, so the trainer process may already be an FSDP rank
of the default group: a ``TCPStore`` that rank 0 (the trainer) hosts at ``master_address:master_port``
and a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (CUDA) object over it, under the store prefixes
SGLang's ``init_custom_process_group`` ends up with (``{group}``, ``{group}/``, ``{device}/``), so a
trainer's rank 0 meets real SGLang servers as well as serve-model.

    group = join_group("127.0.0.1", 29600, rank=0, world_size=2, group_name="w1", backend="gloo", timeout_s=60)
    group.broadcast(tensor)   # rank 0 sends; every other rank receives into a tensor of the same shape
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from areal_agents.errors import EngineError

BACKENDS = ("gloo", "nccl")


@dataclass
class WeightGroup:
    """One rank's membership of a weight-broadcast group (see the module docstring)."""

    name: str
    rank: int
    world_size: int
    backend: str
    pg: Any = field(repr=False)
    store: Any = field(repr=False)

    @property
    def device(self) -> str:
        """Where this group's tensors live: ``cpu`` for gloo, ``cuda`` for NCCL."""
        return "cuda" if self.backend == "nccl" else "cpu"

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` from rank 0 (in place on the others); raises when a rank is gone or the
        group's timeout passes."""
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([tensor], options).wait()

    def close(self) -> None:
        """Leave the group: its connections close (NCCL: its communicators abort), so peers still waiting in a
        broadcast fail at once."""
        if self.backend == "nccl" and self.pg is not None:
            try:
                self.pg.abort()
            except RuntimeError:  # already aborted by its own error handling
                pass
        self.pg = self.store = None


def join_group(
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float,
) -> WeightGroup:
    """Join (rank 0: host) the group; blocks until all ``world_size`` ranks have joined or ``timeout_s`` passes."""
    if backend not in BACKENDS:
        raise EngineError(f"weight group backend: expects one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise EngineError(f"weight group rank: expects 0 <= rank < world_size={world_size}, got {rank}")
    timeout = datetime.timedelta(seconds=timeout_s)
    from torch.distributed import PrefixStore, TCPStore  # noqa: PLC0415

    store = TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
    device = "cuda" if backend == "nccl" else "cpu"
    prefixed = PrefixStore(f"{device}/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo  # noqa: PLC0415

        options = ProcessGroupGloo._Options()  # noqa: SLF001  (the constructor's only way to name the device)
        options._timeout = timeout  # noqa: SLF001
        host = master_address if rank == 0 else local_address(master_address, master_port)
        options._devices = [ProcessGroupGloo.create_device(hostname=host)]  # noqa: SLF001
        pg = ProcessGroupGloo(prefixed, rank, world_size, options)
    else:
        from torch.distributed import ProcessGroupNCCL  # noqa: PLC0415

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout  # noqa: SLF001
        with nccl_faults_raise():
            pg = ProcessGroupNCCL(prefixed, rank, world_size, options)
    return WeightGroup(group_name, rank, world_size, backend, pg, store)


# Read by ProcessGroupNCCL's constructor. Blocking wait: a broadcast's `wait()` returns when the transfer is done
# and raises on an error or past the group's timeout (as gloo's does), instead of leaving it to the watchdog;
# CleanUpOnly (2): an error aborts this group's communicators and does not tear the process down, whose
# default (3) would take a trainer down with a server that died mid-push.
NCCL_WEIGHT_GROUP_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
_environ_lock = threading.Lock()


@contextmanager
def nccl_faults_raise() -> Iterator[None]:
    """`NCCL_WEIGHT_GROUP_ENV` for the process group made inside: a dead server costs a push, not the trainer.
    The trainer's own groups (FSDP2's) keep the default: a rank lost there ends the run."""
    with _environ_lock:
        saved = {key: os.environ.get(key) for key in NCCL_WEIGHT_GROUP_ENV}
        os.environ.update(NCCL_WEIGHT_GROUP_ENV)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what a peer there can reach this one at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


def plan_buckets(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """The state dict's names in its order, cut into buckets of at most ``bucket_bytes`` (a larger tensor
    goes alone): the order both sides send and receive in."""
    buckets: list[list[str]] = [[]]
    size = 0
    for name, t in state_dict.items():
        n = t.numel() * t.element_size()
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += n
    return [b for b in buckets if b]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as SGLang's ``dtypes`` field spells it."""
    return str(dtype).removeprefix("torch.")


def receive(group: WeightGroup, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, Any]:
    """A bucket on a receiving rank: each tensor allocated as announced and broadcast into, in order."""
    if not len(names) == len(dtypes) == len(shapes):
        raise EngineError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    out = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        torch_dtype = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(torch_dtype, torch.dtype):
            raise EngineError(f"dtypes: {dtype!r} (of {name}) is not a torch dtype")
        tensor = torch.empty([int(s) for s in shape], dtype=torch_dtype, device=group.device)
        group.broadcast(tensor)
        out[name] = tensor
    return out
