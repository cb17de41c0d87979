"""Driver memory across a checkpoint: the peak RSS of the ``train`` process (the driver) before its first
checkpoint and over the whole run, against the size of the model's weights (issue 44, item 3).

    .venv/bin/python bench/driver_rss.py MODEL_DIR [--nproc 2] [--run-dir DIR] [key=value ...]

``MODEL_DIR``: e.g. ``areal-agents tiny-model --preset qwen3-0.4b MODEL_DIR``. The run is
examples/arithmetic/rl.yaml on that model for 2 steps with ``ppo.trainer=process`` (``--nproc`` > 1:
``ppo.nproc_per_node``), a checkpoint after each step, a small batch and a one-problem evaluation. The
trainers are spawned processes of their own, so the driver's ``VmHWM`` (/proc/PID/status, sampled every
20 ms) counts the driver alone: the rollout loop, its in-process engine and whatever a checkpoint builds
there. Its figure before ``checkpoints/step_1.tmp`` appears is the peak without a checkpoint; the last is
the peak over the run (two checkpoints in it). Runs the code of the repo this script sits in.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def peak_rss(pid: int) -> int | None:
    """The process's peak resident set (``VmHWM``) in bytes; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kib = next((line.split()[1] for line in text.splitlines() if line.startswith("VmHWM:")), None)
    return int(kib) * 1024 if kib is not None else None


def weights_bytes(model_dir: Path) -> int:
    """The size of the model's weight files."""
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def train_command(model_dir: Path, run_dir: Path, nproc: int, extra: list[str]) -> list[str]:
    overrides = [
        f"model.path={model_dir}",
        f"run_dir={run_dir}",
        "steps=2",
        "save_every=1",
        "keep_checkpoints=0",
        "rollout.batch_size=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=4",
        "ppo.trainer=process",
        f"ppo.nproc_per_node={nproc}",
        "ppo.filter_zero_variance_groups=false",
        "eval.num_problems=1",
        "eval.every=0",
    ]
    cli = [sys.executable, "-m", "areal_agents.cli", "train", "examples/arithmetic/rl.yaml"]
    return [*cli, *overrides, *extra, "--overwrite"]


def measure(command: list[str], run_dir: Path) -> tuple[int, int, int]:
    """Run ``command``; the driver's peak RSS before the first checkpoint began, over the run, and its exit code."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, cwd=ROOT, env=env)
    first = run_dir / "checkpoints" / "step_1.tmp"
    before = last = 0
    while proc.poll() is None:
        sample = peak_rss(proc.pid)
        if sample is not None:
            last = sample
            if not first.exists() and not first.with_suffix("").exists():
                before = sample
        time.sleep(0.02)
    return before, last, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--nproc", type=int, default=1, help="ppo.nproc_per_node (1: one trainer process)")
    parser.add_argument("--run-dir", type=Path, default=None, help="default: a temporary directory")
    args, extra = parser.parse_known_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="driver_rss_")) / "run"
    before, peak, code = measure(train_command(args.model_dir.resolve(), run_dir, args.nproc, extra), run_dir)
    size = weights_bytes(args.model_dir)
    print(f"model weights:                      {size / GIB:.2f} GiB")
    print(f"driver peak RSS before checkpoint:  {before / GIB:.2f} GiB")
    print(f"driver peak RSS over the run:       {peak / GIB:.2f} GiB (+{(peak - before) / GIB:.2f} GiB)")
    print(f"checkpoints: {sorted(p.name for p in (run_dir / 'checkpoints').glob('step_*'))}; exit code {code}")
    sys.exit(code)


if __name__ == "__main__":
    main()
