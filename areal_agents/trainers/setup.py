"""Pieces both recipes share: seeding, the env backend, the held-out set, optimizer, run directory."""

from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from areal_agents.config import EnvConfig, EvalConfig, config_to_dict
from areal_agents.envs.backends import EnvBackend, open_env_backend
from areal_agents.rollout.evaluate import distinct_seeds


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


async def open_checked_backend(env: EnvConfig, eval_cfg: EvalConfig, backend: EnvBackend | None = None) -> EnvBackend:
    """The configured env backend (or ``backend``, e.g. a cluster's env servers), with one train and one
    eval env reset now so mistakes fail early."""
    backend = backend or open_env_backend(env)
    try:
        await backend.check()
        await backend.check(**eval_cfg.env_kwargs)
    except BaseException:
        await backend.aclose()
        raise
    return backend


async def held_out_seeds(backend: EnvBackend, eval_cfg: EvalConfig) -> list[int]:
    return await distinct_seeds(lambda: backend.make(**eval_cfg.env_kwargs), eval_cfg.num_problems, start=eval_cfg.seed)


def make_optimizer(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float,
    warmup_steps: int,
    schedule: str = "constant",
    total_steps: int = 0,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW with a linear warm-up, then a constant rate or a decay to 0 at ``total_steps``
    (``linear`` or ``cosine``; optimizer steps)."""
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr_schedule: expects 'constant', 'linear' or 'cosine', got {schedule!r}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
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


def prepare_run_dir(run_dir: str | Path, cfg: Any) -> Path:
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    return out
