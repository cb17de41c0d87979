"""What produced an eval run: the model (path and a content hash), the engine, the env and sampling
settings, and the problems' hash. ``OUT/run.json`` holds it; a rerun resumes only when it matches.

Settings that only choose how many samples or problems to score (``n_samples``, ``num_problems``, the
date window, concurrency) are not part of it: a rerun with more samples resumes and adds them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from areal_agents.config import config_diff
from areal_agents.errors import ConfigError

RUN_FILE = "run.json"
# what an eval writes in its output directory (its engine's servers and weights too); --overwrite removes these
EVAL_FILES = (RUN_FILE, "samples.jsonl", "summary.json", "failures.log", "servers", "engine_weights")
# files that decide what a checkpoint computes: its config, weights and tokenizer (not READMEs, logs)
MODEL_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja", ".py")


class RunMismatch(ConfigError):
    """An output directory holds samples of another model, engine, dataset or sampling settings."""


def model_digest(path: str | Path) -> str:
    """A content hash of a checkpoint directory's config, weights and tokenizer files (a non-directory,
    e.g. a hub id, hashes as its name)."""
    root = Path(path)
    h = hashlib.blake2b(digest_size=16)
    if not root.is_dir():
        h.update(str(path).encode())
        return h.hexdigest()
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in MODEL_SUFFIXES):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        with f.open("rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def rows_digest(rows: list[Any]) -> str:
    """A hash of the problems as the env holds them (dataset rows, or the seeds of an env without one)."""
    h = hashlib.blake2b(digest_size=16)
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, default=str).encode() + b"\n")
    return h.hexdigest()


def claim(out: Path, identity: dict[str, Any]) -> None:
    """Make ``out`` this run's directory: write ``run.json``, or check the one there matches ``identity``.

    Raises `RunMismatch` naming what differs, or when samples exist without a ``run.json``."""
    record = out / RUN_FILE
    if record.is_file():
        previous = json.loads(record.read_text())
        diff = config_diff(previous, identity)
        if diff:
            raise RunMismatch(
                f"{out} holds an eval of something else ({'; '.join(diff)}): give another --out, or pass "
                "--overwrite to replace it"
            )
        return
    if (out / "samples.jsonl").is_file():
        raise RunMismatch(
            f"{out} holds samples of an unrecorded run (no {RUN_FILE}): give another --out, or pass --overwrite "
            "to replace them"
        )
    out.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(identity, indent=2) + "\n")


def fresh_candidates(out: Path) -> list[Path]:
    """``out``, then ``out-2``, ``out-3``, ...: where a default output directory may go instead."""
    return [out] + [out.with_name(f"{out.name}-{k}") for k in range(2, 100)]


def clear(out: Path) -> None:
    """Remove an earlier eval's files (`EVAL_FILES`) from ``out``, so a new run starts there from nothing."""
    for name in EVAL_FILES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
