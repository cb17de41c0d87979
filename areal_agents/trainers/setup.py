"""Pieces both recipes share: seeding, the env backend, the held-out set, optimizer, run directory."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from areal_agents.config import EnvConfig, EvalConfig, config_to_dict
from areal_agents.envs.backends import EnvBackend, open_env_backend
from areal_agents.rollout.evaluate import distinct_seeds


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


async def open_checked_backend(env: EnvConfig, eval_cfg: EvalConfig) -> EnvBackend:
    """The configured env backend, with one train and one eval env reset now so mistakes fail early."""
    backend = open_env_backend(env)
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
    model: PreTrainedModel, lr: float, weight_decay: float, warmup_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW with a linear warm-up to a constant learning rate."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    )
    return optimizer, scheduler


def prepare_run_dir(run_dir: str | Path, cfg: Any) -> Path:
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    return out
