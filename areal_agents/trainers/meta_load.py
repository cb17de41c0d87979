"""Sharded loading as torchtitan does it: every rank builds its models on the meta device (no weights), shards
them (`fsdp.shard`), gives them empty storage for their shards (``to_empty``), and rank 0 alone reads the
checkpoint and broadcasts it tensor by tensor; each rank keeps its shard
(``set_model_state_dict(..., broadcast_from_rank0=True)``). A rank holds its shards and one full tensor in
flight; rank 0 also the checkpoint it read, one model at a time. The old way held every model whole on every
rank before sharding (28 GB per copy of a 7B float32 model).

Three things a meta build has no weights for, set after ``to_empty``:

- non-persistent buffers (rotary ``inv_freq``): in no checkpoint; `models.loading.empty_model` builds them for
  real on the CPU (parameters alone on meta) and `materialize` puts them back;
- tied parameters (``lm_head`` on ``embed_tokens``): FSDP2 keeps the tie through ``to_empty`` (torch 2.13);
  `materialize` ties them again if it did not, so the head trains as the embedding;
- persistent buffers and parameters: loaded from rank 0's state dict.

    lm = empty_model(path, "float32")                    # every rank: no weights
    root = fsdp.shard(ScoredLM(lm), lm.get_decoder().layers, device, dtype)
    state = prefixed(load_model(path).state_dict(), "lm.") if dp.rank == 0 else {}
    materialize(root, device, state)                     # every rank: its shards of rank 0's weights
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

_BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def materialize(root: nn.Module, device: torch.device, state: dict[str, torch.Tensor]) -> None:
    """A sharded meta-built ``root`` on ``device`` with rank 0's weights: ``state`` is its full state dict
    (``root``'s names) on rank 0 and ``{}`` elsewhere; call it on every rank, in the same order."""
    buffers = _non_persistent_buffers(root)
    tied = _tied(root)
    root.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            root.get_buffer(name).copy_(value)
    _tie(root, tied)
    set_model_state_dict(root, state, options=_BROADCAST)


def prefixed(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """``state`` under ``prefix`` (an LM's weights as its `ScoredLM` root names them: ``"lm."``)."""
    return {prefix + name: value for name, value in state.items()}


def _non_persistent_buffers(root: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the buffers no state dict holds, by name (``to_empty`` leaves garbage in them)."""
    out = {}
    for module_name, module in root.named_modules():
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None:
                out[f"{module_name}.{name}" if module_name else name] = buffer.detach().clone()
    return out


def _tied(root: nn.Module) -> list[tuple[str, str]]:
    """``(name, owner)`` for each parameter registered under a second name (tied embeddings)."""
    owners: dict[int, str] = {}
    pairs = []
    for name, param in root.named_parameters(remove_duplicate=False):
        owner = owners.setdefault(id(param), name)
        if owner != name:
            pairs.append((name, owner))
    return pairs


def _tie(root: nn.Module, tied: list[tuple[str, str]]) -> None:
    for name, owner in tied:
        module_name, _, attr = name.rpartition(".")
        module = root.get_submodule(module_name)
        if module._parameters[attr] is not root.get_parameter(owner):
            module._parameters[attr] = root.get_parameter(owner)
