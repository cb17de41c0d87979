"""FSDP2 for the trainer: each decoder layer and the root sharded across the ranks (`fully_shard`), the
forward/backward in the compute dtype with float32 master weights and gradient reduction, and full state
dicts gathered for checkpoints and weight pushes (``torch.distributed.checkpoint.state_dict``).

Gradients are summed across ranks, not averaged: `ppo_update` divides each micro-batch's loss by the
minibatch's loss tokens over all ranks, so the sum is the single-process gradient. The full optimizer
state is kept in the single-process layout (parameters numbered in order), so a checkpoint of N ranks
resumes on any number of ranks, one included (the unsharded trainer).

    scored, reference, critic = shard_policy(model, reference, critic, dp.device, torch.bfloat16)
    weights = full_state_dict(scored)  # on rank 0 (the LM's names); {} on the others
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import PreTrainedModel

from areal_agents.trainers.batching import ScoredLM
from areal_agents.trainers.critic import ValueModel

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered by all, kept by rank 0


def shard(root: nn.Module, layers: nn.ModuleList, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``fully_shard`` each of ``layers``, then ``root`` (the rest: embedding, norm, head), on ``device``;
    compute in ``dtype`` (float32: no cast at all), gradients reduced in float32 and summed. Parameters on the
    meta device stay there (`meta_load.materialize` gives them storage); the others go to ``device``."""
    if not any(p.is_meta for p in root.parameters()):
        root.to(device)
    low = dtype != torch.float32
    layer_policy = (
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    )
    # the root's inputs are micro-batches: behavior logprobs and masks must not be cast to bf16
    root_policy = MixedPrecisionPolicy(
        param_dtype=dtype if low else None, reduce_dtype=torch.float32 if low else None, cast_forward_inputs=False
    )
    for layer in layers:
        fully_shard(layer, mp_policy=layer_policy)
    fully_shard(root, mp_policy=root_policy)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum: the loss is already over all ranks' tokens
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return root


def shard_policy(
    model: PreTrainedModel,
    reference: PreTrainedModel | None,
    critic: ValueModel | None,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[ScoredLM, ScoredLM | None, ValueModel | None]:
    """The policy (and its reference and critic) sharded for `ppo_update`: each LM as a `ScoredLM` root."""
    scored = shard(ScoredLM(model), model.get_decoder().layers, device, dtype)
    if reference is not None:
        reference = shard(ScoredLM(reference), reference.get_decoder().layers, device, dtype)
    if critic is not None:
        critic = shard(critic, critic.body.layers, device, dtype)
    return scored, reference, critic


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def full_state_dict(root: nn.Module) -> dict[str, torch.Tensor]:
    """A sharded root's full weights on the CPU, gathered by every rank (call it on all), kept by rank 0;
    a `ScoredLM`'s under its LM's names (what ``save_pretrained`` and the engines call them)."""
    state = get_model_state_dict(root, options=_FULL)
    if isinstance(root, ScoredLM):
        state = {k.removeprefix("lm."): v for k, v in state.items()}
    return state


def tied_as_one(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (gathered, one tensor per name) with every name of a shared parameter (tied embeddings) on one
    tensor, as the unsharded model's state dict has them: ``save_pretrained`` then writes it once."""
    owners: dict[int, str] = {}
    tied = dict(state)
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = owners.setdefault(id(param), name)
        if owner != name and owner in tied and name in tied:
            tied[name] = tied[owner]
    return tied


def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Full weights (every rank holding them) into ``module``'s shards."""
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state in ``optimizer.state_dict()``'s single-process layout (parameters
    numbered in order); gathered by every rank, kept by rank 0 (``{}`` elsewhere)."""
    state = get_optimizer_state_dict(module, optimizer, options=_FULL)
    if not state:
        return {}
    number = {name: i for i, name in enumerate(_names(module, optimizer))}
    groups = [group | {"params": [number[n] for n in group["params"]]} for group in state["param_groups"]]
    return {"state": {number[n]: v for n, v in state["state"].items()}, "param_groups": groups}


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """A `full_optimizer_state` (or an unsharded ``optimizer.state_dict()``) into ``optimizer``'s shards, as
    this rank's own copy: torch keeps a loaded ``step`` tensor as given, and the ranks' states arrive sharing
    one storage (a torch.multiprocessing pipe sends every rank the same shared memory), so N ranks stepping
    the given tensors would count each step N times."""
    state = copy.deepcopy(state)
    names = _names(module, optimizer)
    groups = [group | {"params": [names[i] for i in group["params"]]} for group in state["param_groups"]]
    named = {"state": {names[i]: v for i, v in state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(module, optimizer, named, options=StateDictOptions(full_state_dict=True))
    for group, given in zip(optimizer.param_groups, state["param_groups"]):  # as given: DCP makes tuples lists
        group.update((key, value) for key, value in given.items() if key != "params")  # (AdamW's betas)


def _names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter of ``optimizer``, in its order (the single-process numbering)."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


@contextlib.contextmanager
def gradient_sync(modules: Sequence[nn.Module | None], sync: bool) -> Iterator[None]:
    """Within it, the sharded ones of ``modules`` reduce-scatter their gradients in backward only if ``sync``
    (back to syncing after): for all but the last micro-batch of an optimizer step, ``sync=False`` keeps each
    rank's gradient unsharded, added up over the micro-batches, and the last one's backward reduce-scatters
    the sum once (FSDP2 adds the new unsharded gradient to the kept one before the reduce; every rank runs as
    many micro-batches, `DataParallel.share`'s zero-loss padding included, so the collectives match).

    Memory: until that last backward every rank holds a full unsharded gradient of the trained parameters
    (float32, the reduce dtype), not its shard: a model's size per rank, freed by the reduce-scatter."""
    sharded = [m for m in modules if m is not None and is_sharded(m)]
    for module in sharded:
        module.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        for module in sharded:
            module.set_requires_gradient_sync(True)
