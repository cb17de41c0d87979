"""The optimizer, its learning-rate schedule (warm-up, then constant, linear or cosine decay) and its step."""

from __future__ import annotations

import functools
import math

import torch
from torch.distributed.tensor import DTensor


def make_optimizer(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float,
    warmup_steps: int,
    schedule: str = "constant",
    total_steps: int = 0,
    params: list[torch.nn.Parameter] | None = None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over ``params`` (default: ``model``'s parameters that require gradients) with a linear warm-up,
    then a constant rate or a decay to 0 at ``total_steps`` (``linear`` or ``cosine``; optimizer steps)."""
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr_schedule: expects 'constant', 'linear' or 'cosine', got {schedule!r}")
    trained = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, warmup_steps=warmup_steps, schedule=schedule, total_steps=total_steps)
    )


def lr_factor(step: int, *, warmup_steps: int, schedule: str, total_steps: int) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


def optimizer_step(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float,
    *,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    grad_divisor: float = 1.0,
) -> float:
    """Divide the gradients of ``optimizer``'s parameters (``module``'s trained ones; summed over ranks already,
    when sharded) by ``grad_divisor``, clip to ``max_grad_norm`` and step (the schedule too, if any); the
    gradient norm before clipping. Parameters of another policy sharing ``module`` (a LoRA base) are not touched."""
    params = [p for group in optimizer.param_groups for p in group["params"]]  # a LoRA policy: its adapter's
    if grad_divisor != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.div_(grad_divisor)
    grad_norm = clip_grad_norm(params, max_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return grad_norm


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip to ``max_norm`` by the global gradient norm (over every rank's shards when FSDP-sharded);
    the norm before clipping."""
    if not parameters or not isinstance(parameters[0], DTensor):
        return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # the shards' partial norms, reduced
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return float(norm)
