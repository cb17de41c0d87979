"""`DataParallel`: what one rank of a data-parallel trainer needs inside `ppo_update`.

Every rank holds the whole model and sees the whole batch (so advantages, minibatch order and
micro-batches are the same everywhere); it runs forward/backward on its share of each minibatch's
micro-batches, balanced by token count. Gradients are summed across ranks (the loss is already
normalised by the minibatch's global loss-token count), so every rank takes the same optimizer step
the single-process trainer would take on the same data (torch.distributed; gloo, as the trainer computes
on CPU).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from areal_agents.trainers.microbatch import MicroBatch


@dataclass
class DataParallel:
    rank: int
    world_size: int

    @classmethod
    def init(cls, rank: int, world_size: int, master: str, backend: str = "gloo") -> DataParallel:
        """Join the process group (``master`` is ``host:port`` of rank 0)."""
        dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=world_size)
        return cls(rank, world_size)

    def share(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """This rank's micro-batches: largest first, each to the rank with the fewest tokens so far."""
        load = [(0, r) for r in range(self.world_size)]
        mine = []
        for k in sorted(range(len(micro_batches)), key=lambda k: -micro_batches[k].num_tokens):
            tokens, rank = heapq.heappop(load)
            heapq.heappush(load, (tokens + micro_batches[k].num_tokens, rank))
            if rank == self.rank:
                mine.append(micro_batches[k])
        return mine

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Start every rank from rank 0's weights (as DDP does), whatever each rank loaded or drew."""
        with torch.no_grad():
            for t in module.state_dict().values():
                dist.broadcast(t, src=0)

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum gradients across ranks in one flat buffer (a rank without micro-batches sends zeros)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Sum per-rank partial sums (same keys on every rank, in sorted order)."""
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def gather(self, part: dict[int, Any]) -> dict[int, Any]:
        """Merge every rank's ``{trajectory index: value}``."""
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, part)
        return {k: v for p in parts for k, v in p.items()}

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
