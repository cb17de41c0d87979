"""Where `HFEngine` computes and in what precision; weights shared with a trainer in the same process.

On CPU nothing moves and nothing is cast: the engine computes in the model's own dtype, as always. On
CUDA a float32 model computes in bfloat16: its weights are cast once, or, when they are shared with the
trainer (``share_weights``: the trainer's float32 master weights, the single-GPU colocated mode), they stay
float32 and the engine's steps run under autocast. The KV cache defaults to the compute dtype.

Sharing points the engine's parameters at the trainer's tensors (``load_state_dict(assign=True)`` of
`shareable`'s): no copy, so a trainer's optimizer step changes what the engine computes with. That is sound
only while the trainer never steps between a push and the tokens generated under it (a synchronous run), so
the engine records each parameter's in-place version counter at every push and refuses to decode once they
moved.

    placement = Placement.of(torch.float32, "cuda", "auto", share_weights=True)   # fp32 weights, bf16 autocast
    model = placement.place(model)
    with placement.precision():
        logits = model(input_ids.to(placement.device)).logits
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from areal_agents.errors import ConfigError, EngineError
from areal_agents.models.device import autocast, resolve_device
from areal_agents.models.loading import DTYPES

COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # HFEngine's compute_dtype (engine.dtype)


@dataclass(frozen=True)
class Placement:
    """The engine's device, the dtype its matrix products run in, and the dtype its weights are kept in
    (they differ only for shared weights: the steps then run under autocast)."""

    device: torch.device
    dtype: torch.dtype
    weights_dtype: torch.dtype

    @classmethod
    def of(
        cls,
        model_dtype: torch.dtype,
        device: str | torch.device = "cpu",
        dtype: str = "auto",
        share_weights: bool = False,
    ) -> Placement:
        """``dtype`` ``auto``: bfloat16 for a float32 model on CUDA, else the model's own (CPU: unchanged).
        Shared weights keep the model's dtype (the trainer's); others are cast to the compute dtype."""
        if isinstance(device, str):
            where = resolve_device(device)
        else:  # a torch.device; plain "cuda" gets its index, which tensors report
            where = resolve_device("cuda") if device.type == "cuda" and device.index is None else device
        if dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"compute_dtype: expects one of {', '.join(COMPUTE_DTYPES)}, got {dtype!r}")
        if dtype == "auto":
            compute = torch.bfloat16 if where.type == "cuda" and model_dtype == torch.float32 else model_dtype
        else:
            compute = DTYPES[dtype]
        return cls(where, compute, model_dtype if share_weights else compute)

    @property
    def autocast(self) -> bool:
        """The steps run under autocast: weights kept in another dtype than the one computed in."""
        return self.weights_dtype != self.dtype

    def place(self, model: PreTrainedModel) -> PreTrainedModel:
        """``model`` on the device, its parameters in the weights' dtype (in place; nothing happens when they
        are there already). Buffers keep their dtype: the rotary frequencies stay float32, as
        ``from_pretrained(dtype=bfloat16)`` leaves them."""
        if model.device != self.device:
            model = model.to(self.device)
        if model.dtype != self.weights_dtype:
            with torch.no_grad():
                for param in model.parameters():  # tied ones are one Parameter: they stay tied
                    param.data = param.data.to(self.weights_dtype)
        return model

    def precision(self) -> contextlib.AbstractContextManager[None]:
        """Autocast to the compute dtype over shared weights; nothing otherwise (the CPU path as it was)."""
        return autocast(self.device, self.dtype) if self.autocast else contextlib.nullcontext()

    def bind_thread(self) -> None:
        """Make the engine's GPU the current one of the calling thread (the decode thread's own setting)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)


def shareable(state_dict: dict[str, Any], placement: Placement) -> dict[str, torch.Tensor]:
    """``state_dict``'s tensors, detached, for ``model.load_state_dict(..., assign=True)`` to point the engine's
    parameters at (the trainer's: no copy). `EngineError` names a tensor that is not a plain one on the
    engine's device in its weights' dtype, before any is assigned."""
    tensors = {}
    for name, value in state_dict.items():
        tensor = value.detach() if isinstance(value, torch.Tensor) else value
        if type(tensor) is not torch.Tensor:  # noqa: E721  (a subclass: FSDP's DTensor shards)
            raise EngineError(
                f"update_weights: {name} is a {type(value).__name__}, not a plain tensor: an engine that shares "
                "weights (share_weights=True, engine.weight_sync=in_process) needs the whole unsharded model in "
                "this process; use engine.weight_sync=disk or broadcast for sharded trainers"
            )
        if tensor.device != placement.device or tensor.dtype != placement.weights_dtype:
            raise EngineError(
                f"update_weights: {name} is {tensor.dtype} on {tensor.device}, but this engine shares weights "
                f"(share_weights=True) in {placement.weights_dtype} on {placement.device}: the trainer and the "
                "engine must hold the same dtype on the same device (set ppo.device and engine.device alike, "
                "and model.dtype), or use engine.weight_sync=disk"
            )
        tensors[name] = tensor  # detached: assign must not turn the trainer's requires_grad off
    return tensors


def weight_versions(model: torch.nn.Module) -> tuple[int, ...]:
    """Every parameter's in-place version counter: it moves when anyone (an optimizer) writes the tensor."""
    return tuple(p._version for p in model.parameters())  # noqa: SLF001


def moved_weights_error(version: int) -> EngineError:
    """What a sharing engine says when the trainer changed the weights after they were pushed."""
    return EngineError(
        f"the weights this engine shares with the trainer (share_weights=True, engine.weight_sync=in_process) "
        f"changed after version {version} was pushed: its tokens would come from weights of no version. "
        "In-process sharing needs a synchronous run: set rollout.max_staleness=0 and push the weights after "
        "every optimizer step before generating again, or use engine.weight_sync=disk"
    )
