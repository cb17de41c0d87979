"""`DataParallel`: what one rank of an FSDP2 trainer needs inside `ppo_update`, and the update's FLOP count.

Every rank holds a shard of the model (`fsdp.py`) and sees the whole batch (so advantages, minibatch
order and micro-batches are the same everywhere); it runs forward/backward on its share of each
minibatch's micro-batches, balanced by token count and padded with zero-loss micro-batches so that
every rank runs as many forward and backward passes (each one is a collective under FSDP2). Gradients
are summed across ranks (the loss is already normalised by the minibatch's global loss-token count), so
every rank takes the step the single-process trainer would take on the same data.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig, PreTrainedModel

from areal_agents.trainers.microbatch import MicroBatch


def model_flops(tokens: float, parameters: int, layers: int, attention_width: int, attended: float) -> float:
    """FLOPs of forward + backward over ``tokens``, PaLM-style (Chowdhery et al. 2022, appendix B):
    ``6 N`` per token for the ``N`` parameters' matmuls, plus ``12 · layers · attention_width`` per attended
    position for attention's scores and values, ``attention_width`` being heads x head dim (`attention_width`);
    ``attended`` sums, over sequences, the positions each token attends (causal: ``L (L + 1) / 2`` for a
    sequence of ``L`` tokens)."""
    return 6.0 * parameters * tokens + 12.0 * layers * attention_width * attended


def attention_width(config: PretrainedConfig) -> int:
    """Query heads x head dim: the width attention's scores and values multiply over. Not always the hidden
    size: Qwen3-0.6B's is 16 x 128 = 2048 against a hidden size of 1024."""
    heads = config.num_attention_heads
    return heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)


def lm_flops(lm: PreTrainedModel, tokens: float, attended: float) -> float:
    """`model_flops` of ``lm`` (its global parameter count, sharded or not; tied weights once) over ``tokens``
    computed tokens attending ``attended`` positions."""
    config = lm.config.get_text_config()
    parameters = sum(p.numel() for p in lm.parameters())
    return model_flops(tokens, parameters, config.num_hidden_layers, attention_width(config), attended)


@dataclass
class DataParallel:
    """One rank of the trainer's process group (``device``: this rank's)."""

    rank: int
    world_size: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def init(cls, rank: int, world_size: int, master: str, backend: str = "gloo") -> DataParallel:
        """Join the process group (``master`` is ``host:port`` of rank 0)."""
        dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=world_size)
        return cls(rank, world_size)

    @classmethod
    def from_env(cls, device: torch.device) -> DataParallel:
        """Join the process group torchrun's way (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``):
        NCCL on CUDA, gloo on CPU; ``device`` is this rank's."""
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size)
        return cls(rank, world_size, device)

    def share(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """This rank's micro-batches: largest first, each to the rank with the fewest tokens so far; then
        zero-loss copies of the smallest (`MicroBatch.padding`) up to the most any rank got."""
        load = [(0, 0, r) for r in range(self.world_size)]  # (tokens, micro-batches, rank)
        mine = []
        for k in sorted(range(len(micro_batches)), key=lambda k: -micro_batches[k].num_tokens):
            tokens, count, rank = heapq.heappop(load)
            heapq.heappush(load, (tokens + micro_batches[k].num_tokens, count + 1, rank))
            if rank == self.rank:
                mine.append(micro_batches[k])
        most = max(count for _, count, _ in load)
        if len(mine) < most:
            smallest = min(micro_batches, key=lambda mb: mb.num_tokens)
            mine += [smallest.padding() for _ in range(most - len(mine))]
        return mine

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Start every rank from rank 0's weights (as DDP does), whatever each rank loaded or drew."""
        with torch.no_grad():
            for t in module.state_dict().values():
                dist.broadcast(t, src=0)

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Sum per-rank partial sums (same keys on every rank, in sorted order)."""
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def gather(self, part: dict[int, Any]) -> dict[int, Any]:
        """Merge every rank's ``{trajectory index: value}``."""
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, part)
        return {k: v for p in parts for k, v in p.items()}

    @property
    def _comm_device(self) -> torch.device:
        """Where a collective's tensors go: NCCL reduces only CUDA tensors."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
