"""The micro-batch: what one forward and backward of the trainer runs on.

`batching.py` builds them (padded, or packed by `packing.py`), `spread` lays per-trajectory tensors out
like them, and the losses and the critic read them. This module imports neither of those, so they need
not import each other for the type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class SharedPrompts:
    """The row the model runs on when prompts are shared: ``input_ids``/``position_ids`` ``[1, Tc]``;
    ``expand[t]`` is the row position of token t of the trajectory layout (``MicroBatch.input_ids``)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    expand: torch.Tensor
    prompts: tuple[tuple[int, int], ...]  # (start, length) of each prompt in the row
    completions: tuple[tuple[int, int, int, int], ...]  # (start, length, its prompt's start, prompt length)


@dataclass
class MicroBatch:
    """Tensors ``[B, L]`` (right-padded) or ``[1, T]`` (packed); trajectory ``index[k]`` is ``[row, start:end]``
    of them, ``slices[k] = (row, start, end)``."""

    index: list[int]
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    prox_logprobs: torch.Tensor | None = None
    slices: list[tuple[int, int, int]] | None = None
    position_ids: torch.Tensor | None = None  # packed: restarts at 0 for every trajectory
    cu_seqlens: torch.Tensor | None = None  # packed: trajectory boundaries [0, l1, l1 + l2, ...]
    shared: SharedPrompts | None = None  # packed with shared prompts: the shorter row the model runs on
    versions: torch.Tensor | None = None  # the policy version of each generated token (long), -1 elsewhere

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_tokens(self) -> int:
        """Tokens the model runs on (what a micro-batch costs)."""
        return (self.shared.input_ids if self.shared is not None else self.input_ids).numel()

    @property
    def computed_tokens(self) -> int:
        """Tokens of its trajectories the model computes: all of them, but each shared prompt once (the
        shared row); none of a padded layout's padding, nor of a rank's zero-loss copy (`padding`)."""
        if not self.slices:
            return 0
        if self.shared is not None:
            return self.shared.input_ids.numel()
        return sum(b - a for _, a, b in self.slices)

    @property
    def attended(self) -> int:
        """Positions attended by the tokens `computed_tokens` counts, causal within each trajectory: ``L (L + 1)
        / 2`` for ``L`` tokens. A shared prompt of ``P`` tokens counts ``P (P + 1) / 2`` once and each of its
        completions of ``W`` tokens ``W P + W (W + 1) / 2`` (all of its prompt, then causally itself)."""
        if not self.slices:
            return 0
        if self.shared is not None:
            prompts = sum(p * (p + 1) // 2 for _, p in self.shared.prompts)
            return prompts + sum(w * p + w * (w + 1) // 2 for _, w, _, p in self.shared.completions)
        return sum((b - a) * (b - a + 1) // 2 for _, a, b in self.slices)

    def to(self, device: torch.device) -> MicroBatch:
        """Its tensors on ``device`` (one copy each; ``cu_seqlens``, read as a list, stays on the CPU); itself
        when they are there already (the CPU path)."""
        if self.input_ids.device == device:
            return self
        moved = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "cu_seqlens"}
        moved = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
        if self.shared is not None:
            sh = self.shared
            moved["shared"] = replace(
                sh,
                input_ids=sh.input_ids.to(device),
                position_ids=sh.position_ids.to(device),
                expand=sh.expand.to(device),
            )
        return replace(self, **moved)

    def padding(self) -> MicroBatch:
        """A zero-loss copy for a rank with fewer micro-batches than another: the same forward and backward
        (every FSDP rank runs as many collectives), no loss tokens and no trajectories of its own."""
        return replace(self, index=[], slices=[], loss_mask=torch.zeros_like(self.loss_mask))


def spread(mb: MicroBatch, per_trajectory: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor per trajectory (indexed like the ``make_micro_batches`` input) laid out like ``mb``."""
    out = torch.zeros(mb.loss_mask.shape, dtype=mb.loss_mask.dtype)  # filled on the CPU, then moved at once
    for (row, a, b), i in zip(mb.slices, mb.index):
        out[row, a:b] = per_trajectory[i]
    return out.to(mb.loss_mask.device)
