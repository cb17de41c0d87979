"""Checkpoints: a loadable model directory plus the trainer state needed to continue.

Layout of ``run_dir/checkpoints/step_N/``: ``model/`` (``save_pretrained`` weights, config and
tokenizer, loadable by any transformers code or as ``model.path``; a LoRA policy's is PEFT's adapter
directory, for ``PeftModel.from_pretrained`` over the base; with separate policies one
``policies/AGENT/model/`` each), ``trainer_state.pt`` (optimizer, scheduler, step, policy version, rollout
ledger, data position, RNG states). A checkpoint is written
under ``step_N.tmp`` and renamed when complete, so a run killed while saving leaves no half checkpoint.

A checkpoint resumes on any host: the train state is written as CPU tensors and read with
``map_location="cpu"`` (``Optimizer.load_state_dict`` and FSDP2's ``set_optimizer_state_dict`` move each
state to its parameter's device). The CUDA RNG of every GPU is saved beside the CPU's and put back when
this host has as many GPUs; on another host (or one without CUDA) it is left as seeded, and a checkpoint
written before it was saved resumes the same way.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


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
    tmp.mkdir(parents=True)
    for directory, write in models.items():
        out = tmp / directory
        out.mkdir(parents=True)
        write(out)
        tokenizer.save_pretrained(out)
    torch.save({"step": step, "rng": rng_states(), **on_cpu(state)}, tmp / "trainer_state.pt")
    for add in train_states:
        add(tmp / "trainer_state.pt")
    shutil.rmtree(ckpt, ignore_errors=True)
    os.replace(tmp, ckpt)
    return ckpt


def add_train_state(path: Path, state: dict[str, Any], key: str | None = None) -> None:
    """Add a policy's train state to a checkpoint's ``trainer_state.pt`` at ``path``: at its top (``key`` None:
    the run's one shared policy) or under ``["policies"][key]``."""
    saved = torch.load(path, map_location="cpu", weights_only=False)
    state = on_cpu(state)
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
    """The trainer state of a checkpoint (its tensors on the CPU, wherever they were saved from), with the
    global RNGs restored from it (`restore_rng_states`). Memory-mapped: the policies' optimizer states in it are
    read by their trainers (`read_train_state`), never into this process."""
    state = torch.load(Path(ckpt) / "trainer_state.pt", map_location="cpu", weights_only=False, mmap=True)
    restore_rng_states(state["rng"])
    return state


def on_cpu(value: Any) -> Any:
    """``value`` with every tensor in its dicts, lists and tuples copied to the CPU (what a checkpoint holds,
    so that a host without the saving GPU reads it); tensors already there are kept as they are."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: on_cpu(v) for k, v in value.items()}
    if type(value) in (list, tuple):  # plain ones (a named tuple is kept whole)
        return type(value)(on_cpu(v) for v in value)
    return value


def rng_states() -> dict[str, Any]:
    """The global RNG states: torch's CPU one, numpy's, Python's, and (with CUDA) every GPU's under ``cuda``."""
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put `rng_states` back. The GPUs' only when this host has CUDA and as many GPUs as the saving one; else
    they stay as seeded (a checkpoint without ``cuda``, from a CPU run or older, resumes so too)."""
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    cuda = states.get("cuda")
    if cuda is None:
        return
    if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
    else:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        logger.warning("checkpoint: CUDA RNG states of %d GPUs not restored (this host has %d)", len(cuda), count)
