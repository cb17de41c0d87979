"""Checkpoints: a loadable model directory plus the trainer state needed to continue.

Layout of ``run_dir/checkpoints/step_N/``: ``model/`` (``save_pretrained`` weights, config and
tokenizer, loadable by any transformers code or as ``model.path``; a LoRA policy's is PEFT's adapter
directory, for ``PeftModel.from_pretrained`` over the base; with separate policies one
``policies/AGENT/model/`` each), ``trainer_state.pt`` (optimizer, scheduler, step, policy version, rollout
ledger, data position, RNG states). A checkpoint is written
under ``step_N.tmp`` and renamed when complete, so a run killed while saving leaves no half checkpoint.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def save_model(out_dir: str | Path, model: PreTrainedModel | Any, tokenizer: PreTrainedTokenizerBase) -> Path:
    """``model.save_pretrained`` (a `PeftModel` writes its adapter alone) and the tokenizer under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    models: dict[str, Callable[[Path], None]],
    tokenizer: PreTrainedTokenizerBase,
    state: dict[str, Any],
    train_states: Sequence[Callable[[Path], None]] = (),
) -> Path:
    """Write ``run_dir/checkpoints/step_{step}`` (atomically): under each relative directory the model files its
    writer puts there (``{"model": policy.save_checkpoint}``: written where the weights live) and the tokenizer,
    ``state`` and the RNG states in ``trainer_state.pt``, to which each of ``train_states`` adds a policy's
    (`add_train_state`, called where that state lives); return its path."""
    ckpt = Path(run_dir) / "checkpoints" / f"step_{step}"
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for directory, write in models.items():
        out = tmp / directory
        out.mkdir(parents=True)
        write(out)
        tokenizer.save_pretrained(out)
    torch.save(
        {
            "step": step,
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
            },
            **state,
        },
        tmp / "trainer_state.pt",
    )
    for add in train_states:
        add(tmp / "trainer_state.pt")
    shutil.rmtree(ckpt, ignore_errors=True)
    os.replace(tmp, ckpt)
    return ckpt


def add_train_state(path: Path, state: dict[str, Any], key: str | None = None) -> None:
    """Add a policy's train state to a checkpoint's ``trainer_state.pt`` at ``path``: at its top (``key`` None:
    the run's one shared policy) or under ``["policies"][key]``."""
    saved = torch.load(path, weights_only=False)
    if key is None:
        saved |= state
    else:
        saved.setdefault("policies", {})[key] = state
    torch.save(saved, path)


def read_train_state(path: Path, key: str | None = None) -> dict[str, Any]:
    """A policy's train state that `add_train_state` put in ``trainer_state.pt`` at ``path`` (at its top for
    ``key`` None, else under ``["policies"][key]``), read by the process that trains it."""
    saved = torch.load(path, map_location="cpu", weights_only=False)
    return saved if key is None else saved["policies"][key]


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    found = [
        p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit() and (p / "trainer_state.pt").is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[5:]))


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (``keep <= 0`` keeps all). Each is renamed to
    ``.tmp`` first, so a run killed mid-delete leaves no half checkpoint, only a ``.tmp`` removed next time."""
    if keep > 0:
        for old in checkpoints(run_dir)[:-keep]:
            trash = old.with_name(old.name + ".tmp")
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(old, trash)
        for leftover in (Path(run_dir) / "checkpoints").glob("step_*.tmp"):
            shutil.rmtree(leftover, ignore_errors=True)


def load_trainer_state(ckpt: str | Path) -> dict[str, Any]:
    """The trainer state of a checkpoint, with the global RNGs restored from it. Memory-mapped: the policies'
    optimizer states in it are read by their trainers (`read_train_state`), never into this process."""
    state = torch.load(Path(ckpt) / "trainer_state.pt", map_location="cpu", weights_only=False, mmap=True)
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    return state
