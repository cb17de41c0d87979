"""Turn trajectories into micro-batches under a token budget, and score tokens with a model.

Padded: sorted by length, right-padded to each micro-batch's longest. Packed (``ppo.packing``'s
default): trajectories are binned first-fit-decreasing into rows of at most the budget and concatenated without
padding; attention stays within each trajectory (`packing.py`). Packed with shared prompts: the
trajectories of one prompt go into the same row, where the model sees that prompt once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from areal_agents.models.logprobs import chunked_token_logprobs
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.microbatch import MicroBatch, spread
from areal_agents.trainers.packing import (
    ffd_bins,
    pack_rows,
    packed_hidden_states,
    packed_token_logprobs,
    prompt_units,
    use_packed_attention,
)
from areal_agents.types import Trajectory

__all__ = [
    "MicroBatch",
    "ScoredLM",
    "hidden_states",
    "make_micro_batches",
    "module_device",
    "per_trajectory",
    "spread",
    "token_logprobs",
]


class ScoredLM(torch.nn.Module):
    """A causal LM whose forward is `token_logprobs`. FSDP2 shards it as the root: the root's hooks
    (gathering the embedding, the final norm and the head) run on the root's own forward, and
    `token_logprobs` calls the decoder and the head apart, never the LM's forward."""

    def __init__(self, lm: PreTrainedModel) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, mb: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
        # a copy, not a view: FSDP2's pre-backward hook would be lost to an in-place op on a view
        return token_logprobs(self.lm, mb, temperature).clone()


def module_device(module: torch.nn.Module) -> torch.device:
    """Where ``module``'s parameters live (the device its micro-batches go to)."""
    return next(module.parameters()).device


def make_micro_batches(
    trajectories: Sequence[Trajectory],
    max_tokens: int,
    advantages: Sequence[float] | None = None,
    pad_token_id: int = 0,
    prox_logprobs: Sequence[torch.Tensor] | None = None,
    pack: bool = False,
    share_prompts: bool = False,
) -> list[MicroBatch]:
    """Split into micro-batches of at most ``max_tokens`` tokens (padded: ``rows * longest``).

    ``prox_logprobs`` (one 1-D tensor per trajectory) rides along, laid out like ``logprobs``.
    ``share_prompts`` (packed only): the budget counts each distinct prompt of a row once.
    """
    adv = advantages if advantages is not None else [0.0] * len(trajectories)
    if pack:
        if share_prompts:
            units, sizes = prompt_units(trajectories, max_tokens)
        else:
            units, sizes = [[i] for i in range(len(trajectories))], [len(t) for t in trajectories]
        bins = [[i for u in b for i in units[u]] for b in ffd_bins(sizes, max_tokens)]
        return [
            pack_rows([trajectories[i] for i in b], [adv[i] for i in b], b, prox_logprobs, share_prompts) for b in bins
        ]
    order = sorted(range(len(trajectories)), key=lambda i: len(trajectories[i]))
    groups: list[list[int]] = []
    for i in order:
        longest = len(trajectories[i])  # sorted ascending, so the newcomer is the longest
        if groups and (len(groups[-1]) + 1) * longest <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
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
    loss_mask = torch.zeros((n, width), dtype=torch.float)
    logprobs = torch.zeros((n, width), dtype=torch.float)
    versions = torch.full((n, width), -1, dtype=torch.long)
    for row, t in enumerate(trajs):
        length = len(t)
        input_ids[row, :length] = torch.tensor(t.input_ids)
        loss_mask[row, :length] = torch.tensor(t.loss_mask, dtype=torch.float)
        logprobs[row, :length] = torch.tensor(t.logprobs, dtype=torch.float)
        versions[row, :length] = torch.tensor(t.versions, dtype=torch.long)
    advantages = torch.tensor(adv, dtype=torch.float)[:, None].expand(n, width) * loss_mask
    slices = [(row, 0, len(t)) for row, t in enumerate(trajs)]
    return MicroBatch(index, input_ids, loss_mask, logprobs, advantages, slices=slices, versions=versions)


def hidden_states(decoder: PreTrainedModel, mb: MicroBatch) -> torch.Tensor:
    """Final hidden states laid out like ``mb.input_ids`` (``[B, L, H]``, or ``[1, T, H]`` packed).

    Padded rows are right-padded, so causal attention alone keeps every real token from the pads after
    it: no attention mask is passed (transformers would build a ``[B, 1, L, L]`` one, quadratic in length)
    and the pads' own outputs, which no loss reads, are whatever they are."""
    if mb.cu_seqlens is not None:
        return packed_hidden_states(decoder, mb)[None]
    use_packed_attention(decoder, False)
    return decoder(input_ids=mb.input_ids, use_cache=False).last_hidden_state


def token_logprobs(model: PreTrainedModel, mb: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / T)`` of each actual token given its prefix, ``[B, L]``; 0 at a trajectory's
    first token. Logits are float32, made a chunk of tokens at a time (`chunked_token_logprobs`).

    ``T`` must be the sampling temperature, so these match the engine's behavior logprobs.
    """
    if isinstance(model, ScoredLM):  # sharded: through the root's forward
        return model(mb, temperature)
    if mb.cu_seqlens is not None:
        return packed_token_logprobs(model, mb, temperature)
    hidden = hidden_states(model.get_decoder(), mb)[:, :-1]  # position t predicts token t + 1
    tokens = mb.input_ids[:, 1:]
    logp = chunked_token_logprobs(hidden.flatten(0, 1), model.get_output_embeddings(), tokens.flatten(), temperature)
    return torch.nn.functional.pad(logp.view(tokens.shape), (1, 0))


def per_trajectory(
    score: Callable[[MicroBatch], torch.Tensor],
    trajectories: Sequence[Trajectory],
    max_tokens: int,
    pad_token_id: int,
    pack: bool = False,
    dp: DataParallel | None = None,
    share_prompts: bool = False,
    device: torch.device | None = None,
) -> list[torch.Tensor]:
    """``score(micro_batch)`` (a tensor laid out like it) cut back into one 1-D float32 CPU tensor per
    trajectory. With ``dp`` each rank scores its share of the micro-batches (as many on every rank) and
    the ranks' parts are gathered. ``device``: where the micro-batches go (None: where they are)."""
    mbs = make_micro_batches(
        trajectories, max_tokens, pad_token_id=pad_token_id, pack=pack, share_prompts=share_prompts
    )
    out: dict[int, torch.Tensor] = {}
    for mb in dp.share(mbs) if dp else mbs:
        values = score(mb if device is None else mb.to(device))
        for (row, a, b), i in zip(mb.slices, mb.index):
            out[i] = values[row, a:b].to("cpu", torch.float32, copy=True)
    if dp:
        out = dp.gather(out)
    return [out[i] for i in range(len(trajectories))]
