"""Turn trajectories into padded micro-batches under a token budget, and score tokens with a model.

Trajectories are sorted by length before splitting so each micro-batch pads little. (True
padding-free packing needs varlen attention kernels, which the GPU path will bring.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from areal_agents.types import Trajectory


@dataclass
class MicroBatch:
    """Right-padded tensors ``[B, L]``; ``index`` maps rows back to positions in the input list."""

    index: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    prox_logprobs: torch.Tensor | None = None

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def make_micro_batches(
    trajectories: Sequence[Trajectory],
    max_tokens: int,
    advantages: Sequence[float] | None = None,
    pad_token_id: int = 0,
    prox_logprobs: Sequence[torch.Tensor] | None = None,
) -> list[MicroBatch]:
    """Split into micro-batches whose padded size ``rows * longest`` stays within ``max_tokens``.

    ``prox_logprobs`` (one 1-D tensor per trajectory) rides along, padded like ``logprobs``.
    """
    order = sorted(range(len(trajectories)), key=lambda i: len(trajectories[i]))
    groups: list[list[int]] = []
    for i in order:
        longest = len(trajectories[i])  # sorted ascending, so the newcomer is the longest
        if groups and (len(groups[-1]) + 1) * longest <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    adv = advantages if advantages is not None else [0.0] * len(trajectories)
    batches = []
    for idx in groups:
        mb = _collate([trajectories[i] for i in idx], [adv[i] for i in idx], idx, pad_token_id)
        if prox_logprobs is not None:
            mb.prox_logprobs = torch.zeros_like(mb.logprobs)
            for row, i in enumerate(idx):
                mb.prox_logprobs[row, : len(prox_logprobs[i])] = prox_logprobs[i]
        batches.append(mb)
    return batches


def _collate(trajs: list[Trajectory], adv: list[float], index: list[int], pad: int) -> MicroBatch:
    n, width = len(trajs), max(len(t) for t in trajs)
    input_ids = torch.full((n, width), pad, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float)
    logprobs = torch.zeros((n, width), dtype=torch.float)
    for row, t in enumerate(trajs):
        length = len(t)
        input_ids[row, :length] = torch.tensor(t.input_ids)
        attention[row, :length] = 1
        loss_mask[row, :length] = torch.tensor(t.loss_mask, dtype=torch.float)
        logprobs[row, :length] = torch.tensor(t.logprobs, dtype=torch.float)
    advantages = torch.tensor(adv, dtype=torch.float)[:, None].expand(n, width) * loss_mask
    return MicroBatch(index, input_ids, attention, loss_mask, logprobs, advantages)


def token_logprobs(model: PreTrainedModel, mb: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / T)`` of each actual token given its prefix, ``[B, L]``; 0 at position 0.

    ``T`` must be the sampling temperature, so these match the engine's behavior logprobs.
    """
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, mb.input_ids[:, 1:, None]).squeeze(2)
    return torch.nn.functional.pad(logp, (1, 0))
