"""What `train --resume` checks and cleans before it continues a run, and what a run directory must be
to start one (`claim_run_dir`: empty, or `--resume`, or `--overwrite`).

A resume continues the run its checkpoint belongs to, so it may change only how long the run goes on and
what it records (`FREE_KEYS`); any other difference from the run's saved ``config.json`` (model, env,
rollout, ppo, engine, seed, ...) would train something else under the same name, and needs
``--allow-config-change``. Records of steps after the checkpoint (a step cut off by a kill, or trained
after the last save) are dropped, so each step is written once: its redo replaces it.

Example::

    changes = check_resume_config(run_dir, cfg, allow_change=True)  # ["ppo.lr: 0.0001 -> 0.001"], or []
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from areal_agents.config import config_diff, config_to_dict
from areal_agents.errors import ConfigError

# keys a resume may change: the run's length, checkpointing, evaluation and logging, and where the same run
# executes (docs/cluster.md: a Ray run resumes locally and the other way round, with any number of ranks)
FREE_KEYS = (
    "run_dir",
    "steps",
    "max_train_minutes",
    "save_every",
    "save_every_minutes",
    "keep_checkpoints",
    "eval",
    "rollout.dump_trajectories",
    "launcher",
    "ray",
    *(f"gateway.{key}" for key in ("host", "port", "api_keys_file", "reward_timeout_s", "session_idle_s")),
    *(f"gateway.{key}" for key in ("max_open_sessions", "max_calls_per_session", "max_body_bytes")),
    *(f"gateway.{key}" for key in ("trajectory_dir", "retention_hours", "replay_dir")),  # serving, not training
)
# what `train` and `sft` write in a run directory (the run's engine servers, separate policies, plots too);
# `--overwrite` removes these and nothing else, so no file of the old run mixes with the new one's
RUN_FILES = (
    "config.json",
    "summary.json",
    "checkpoints",
    "tensorboard",
    "data_order.jsonl",
    "trajectories",
    "eval_samples",
    "timeline",
    "gateway.json",
    "trace.json",
    "failures.log",
    "model",
    "plots",
    "servers",
    "engine_weights",
    "policies",
)

_START_FILES = ("config.json", "failures.log", "servers")


def claim_run_dir(run_dir: str | Path, command: str, *, resume: bool = False, overwrite: bool = False) -> None:
    """Check ``run_dir`` may take a new run of ``command`` (``train``, ``sft``) before anything is written:
    one that holds a run needs ``resume`` (``train --resume`` continues it) or ``overwrite`` (its files,
    `RUN_FILES`, are removed now); else `ConfigError` says which. ``run_dir`` resolves against the cwd."""
    out = Path(run_dir)
    found = [name for name in RUN_FILES if (out / name).exists()]
    if not set(found) - set(_START_FILES) or resume:
        return  # nothing, or only what a start that failed before its first step left (its config, logs)
    if overwrite:
        for name in found:
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        return
    options = (
        "--resume to continue it, --overwrite to start over" if command == "train" else "--overwrite to replace it"
    )
    raise ConfigError(
        f"run_dir {out} holds a run ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}): pass {options}, "
        "or set run_dir=... to another directory"
    )


def check_resume_config(run_dir: str | Path, cfg: Any, allow_change: bool) -> list[str]:
    """Compare ``cfg`` with the run's saved ``config.json`` (none: nothing to compare); return the changes
    outside `FREE_KEYS`, allowed by ``allow_change``, else raise `ConfigError` naming them."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return []
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"--resume: {path} is not valid JSON ({e}); restore it or start a new run_dir") from None
    changes = config_diff(saved, config_to_dict(cfg), ignore=FREE_KEYS, defaults=config_to_dict(type(cfg)()))
    if changes and not allow_change:
        raise ConfigError(
            f"--resume: the config differs from the run's ({path}): {'; '.join(changes)}. Resume with the saved "
            "values, or pass --allow-config-change to continue the run with the new ones (free to change: steps, "
            "max_train_minutes, save_every*, keep_checkpoints, eval.*, rollout.dump_trajectories, launcher, ray.*)"
        )
    return changes


def with_config_rates(train_state: dict[str, Any], lr: float, weight_decay: float, critic_lr: float) -> dict[str, Any]:
    """A policy's checkpointed train state with the config's learning rates and weight decay, the schedule's
    progress and the optimizer moments kept: an allowed change of ``ppo.lr`` (or ``critic_lr``,
    ``weight_decay``) takes effect, where loading the optimizer state would put the old values back."""
    out = dict(train_state)
    out["optimizer"], factors = _with_rates(train_state["optimizer"], lr, weight_decay)
    scheduler = train_state["scheduler"]
    if scheduler["base_lrs"] != [lr] * len(scheduler["base_lrs"]):
        out["scheduler"] = {**scheduler, "base_lrs": [lr] * len(factors), "_last_lr": [lr * f for f in factors]}
    if "critic_optimizer" in train_state:
        out["critic_optimizer"], _ = _with_rates(train_state["critic_optimizer"], critic_lr, weight_decay)
    return out


def _with_rates(optimizer: dict[str, Any], lr: float, weight_decay: float) -> tuple[dict[str, Any], list[float]]:
    """An optimizer state dict with base rate ``lr`` (the current rate scaled as the schedule has it now);
    the schedule's factor of each group. Unchanged groups are left bit for bit."""
    groups, factors = [], []
    for group in optimizer["param_groups"]:
        base = group.get("initial_lr", group["lr"])
        factors.append(group["lr"] / base if base else 1.0)
        group = {**group, "weight_decay": weight_decay}
        if base != lr:
            group |= {"lr": lr * factors[-1], "initial_lr": lr} if "initial_lr" in group else {"lr": lr}
        groups.append(group)
    return {**optimizer, "param_groups": groups}, factors


def forget_after(run_dir: str | Path, step: int) -> None:
    """Drop the run's records of steps after ``step`` (``data_order.jsonl`` rows, trajectory and eval-sample
    dumps), which the resumed run writes again. TensorBoard's are hidden by the writer's ``purge_step``; the
    timeline keeps the killed run's files (what it did, when, stays true)."""
    run_dir = Path(run_dir)
    order = run_dir / "data_order.jsonl"
    if order.is_file():
        kept = [line for line in order.read_text().splitlines(keepends=True) if _step_of(line) <= step]
        tmp = order.with_name(order.name + ".tmp")
        tmp.write_text("".join(line if line.endswith("\n") else line + "\n" for line in kept))
        os.replace(tmp, order)
    for dump in [*(run_dir / "trajectories").glob("step_*.jsonl"), *(run_dir / "eval_samples").glob("step_*.jsonl")]:
        if dump.stem[5:].isdigit() and int(dump.stem[5:]) > step:
            dump.unlink()


def _step_of(line: str) -> int:
    """The step of a ``data_order.jsonl`` row; a torn last row (a kill mid-write) counts as after every step."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62
