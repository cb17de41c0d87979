"""Pieces both recipes share: seeding, env factories, the held-out set, optimizer, run directory."""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from transformers import PreTrainedModel

from areal_agents.config import EnvConfig, EvalConfig, config_to_dict
from areal_agents.envs.registry import import_env_module, make_env
from areal_agents.rollout.evaluate import distinct_seeds


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def env_factories(
    env: EnvConfig, eval_cfg: EvalConfig
) -> tuple[Callable[[], gym.Env], Callable[[], gym.Env]]:
    """(train, eval) env constructors; makes one env of each now so bad ids and kwargs fail at start-up."""
    import_env_module(env.module)
    make_train = functools.partial(make_env, env.id, **env.kwargs)
    make_eval = functools.partial(make_env, env.id, **{**env.kwargs, **eval_cfg.env_kwargs})
    make_train().close()
    make_eval().close()
    return make_train, make_eval


def held_out_seeds(make_eval: Callable[[], gym.Env], eval_cfg: EvalConfig) -> list[int]:
    return distinct_seeds(make_eval, eval_cfg.num_problems, start=eval_cfg.seed)


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
