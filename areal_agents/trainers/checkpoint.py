"""Checkpoints: a loadable model directory plus the trainer state needed to continue.

Layout of ``run_dir/checkpoints/step_N/``: ``model/`` (``save_pretrained`` weights, config and
tokenizer, loadable by any transformers code or as ``model.path``), ``trainer_state.pt`` (optimizer,
scheduler, step, policy version, rollout ledger, RNG states).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def save_model(out_dir: str | Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
) -> Path:
    """Write ``run_dir/checkpoints/step_{step}``; return its path."""
    ckpt = Path(run_dir) / "checkpoints" / f"step_{step}"
    save_model(ckpt / "model", model, tokenizer)
    torch.save(
        {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
            **state,
        },
        ckpt / "trainer_state.pt",
    )
    return ckpt
