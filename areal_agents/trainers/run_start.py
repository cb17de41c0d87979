"""What a run does before its first step: seed, write its run directory, check its envs, pick its held-out set."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from areal_agents.config import EnvConfig, EvalConfig, TimelineConfig, config_to_dict
from areal_agents.data.sources import datasets_in
from areal_agents.envs.runtime.backends import EnvBackend, open_env_backend
from areal_agents.rollout.held_out import distinct_seeds
from areal_agents.timeline import open_timeline
from areal_agents.timeline.samplers import watch_cpu, watch_gpus


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare_run_dir(run_dir: str | Path, cfg: Any) -> Path:
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    return out


async def open_checked_backend(
    env: EnvConfig, eval_cfg: EvalConfig, backend: EnvBackend | None = None, owner: str | None = None
) -> EnvBackend:
    """The configured env backend (or ``backend``, e.g. a cluster's env servers), with one train and one
    eval env reset now so mistakes fail early; ``owner`` names the run on the env servers (`run_owner`)."""
    backend = backend or open_env_backend(env, datasets_in(eval_cfg.env_kwargs), owner=owner)
    try:
        await backend.check()
        await backend.check(**eval_cfg.env_kwargs)
    except BaseException:
        await backend.aclose()
        raise
    return backend


async def held_out_seeds(backend: EnvBackend, eval_cfg: EvalConfig) -> list[int]:
    return await distinct_seeds(lambda: backend.make(**eval_cfg.env_kwargs), eval_cfg.num_problems, start=eval_cfg.seed)


def open_run_timeline(run_dir: Path, cfg: TimelineConfig) -> None:
    """The run's timeline (``RUN/timeline/``) unless ``cfg`` turns it off: this process as ``driver``, its CPU
    use and its GPUs; the processes the run starts from now on record there too."""
    if not cfg.enabled:
        return
    tl = open_timeline(run_dir, "driver", dt=cfg.bin_ms / 1000, max_bytes=int(cfg.max_mib * 2**20))
    watch_cpu(tl, "driver")
    watch_gpus(tl)
