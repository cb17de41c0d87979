"""One rank of serve-tinker's FSDP2 trainer (``--nproc-per-node``): the shared base sharded as `train` shards
its policy (`fsdp.shard`), the training models' adapters replicated beside it.

Tinker adds and drops training models while it serves, and FSDP2 manages only the parameters a module holds
when it is sharded. So the base is wrapped first in a rank-1 *scaffold* adapter on every module a Tinker LoRA
may target (never active, B = 0), then sharded: each later adapter only adds its matrices to those LoRA
layers, as plain parameters every rank holds whole. Every rank scores its share of a request's micro-batches
(`DataParallel.share`) through the sharded root (`TargetScorer`), and `all_reduce_gradients` sums the
adapter's gradients before the optimizer step: the step the single process takes on the same data.

    root = shard_base(base, device, "float32")      # once per base, before any training model
    lp = root(micro_batch, target_tokens)            # on every rank, the same number of times
    all_reduce_gradients(adapter.parameters())       # before optimizer.step(), on every rank
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from areal_agents.config import LoraConfig
from areal_agents.models.logprobs import chunked_token_logprobs
from areal_agents.trainers.batching import hidden_states
from areal_agents.trainers.fsdp import shard
from areal_agents.trainers.lora import LoraBase
from areal_agents.trainers.microbatch import MicroBatch

SCAFFOLD = "_scaffold"  # the adapter that gives every targetable module its LoRA layer before sharding


class TargetScorer(torch.nn.Module):
    """A causal LM whose forward is log π(target_t | tokens[:t+1]) of a packed micro-batch ([T] float32).
    FSDP2 shards it as the root (as `ScoredLM`), so the root's hooks gather the embedding, norm and head."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, mb: MicroBatch, targets: torch.Tensor) -> torch.Tensor:
        return target_logprobs(self.lm, mb, targets)


def target_logprobs(lm: torch.nn.Module, mb: MicroBatch, targets: torch.Tensor) -> torch.Tensor:
    """log π(targets[t] | position t) over a packed micro-batch, [T] float32 (the trainer's float32 head)."""
    hidden = hidden_states(lm.get_decoder(), mb)[0]  # [T, H]: position t, then its target
    return chunked_token_logprobs(hidden, lm.get_output_embeddings(), targets, 1.0)


def shard_base(base: LoraBase, targets: list[str], device: torch.device, dtype: str) -> TargetScorer:
    """``base`` (no adapter on it yet) given the scaffold adapter over ``targets``, then FSDP2-sharded on
    ``device`` (compute in ``dtype``, the weights' own); the sharded root that scores micro-batches."""
    if base.peft is not None:
        raise RuntimeError("shard_base: the base holds adapters already; shard it before the first")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PEFT: the head is tied to the embedding (we never merge)
        scaffold = base.add(SCAFFOLD, LoraConfig(r=1, alpha=1.0, target_modules=list(targets)))
    for p in scaffold.parameters():
        p.requires_grad_(False)  # never trained: PEFT's set_adapter keeps it so (it is never the active one)
    lm = base.peft.get_base_model()
    return shard(TargetScorer(lm), lm.get_decoder().layers, device, getattr(torch, dtype))


def broadcast_from_rank0(params: list[torch.nn.Parameter]) -> None:
    """Every rank's ``params`` set to rank 0's (a new adapter starts the same everywhere)."""
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)


def all_reduce_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum the ranks' gradients of ``params`` (replicated: each rank backpropagated its share), in one
    flat collective; a parameter without a gradient counts as zeros."""
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
