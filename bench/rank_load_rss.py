"""Each FSDP rank's memory across `load_trainable`: its peak RSS (``VmHWM``) while two gloo ranks load a policy,
for this repo's loader and for another checkout's (issue 50 item 2: meta-device loading, rank 0 alone reading).

    .venv/bin/python bench/rank_load_rss.py MODEL_DIR --before-repo DIR [--kl] [--gae]

``MODEL_DIR``: e.g. ``areal-agents tiny-model --preset qwen3-0.4b MODEL_DIR``. ``--before-repo``: a checkout of
the old loader (``git worktree add DIR cb1f809``), whose code the first pair of ranks runs; the second pair runs
the code of the repo this script sits in. One pair at a time. Each rank reports its RSS when its process group
is up (before the load), its peak over the load, and the rise, against the size of the model's weight files;
the last lines are each rank's rise after over before. ``--kl`` adds the reference model, ``--gae`` the critic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def status_bytes(field: str) -> int:
    """This process's ``field`` (``VmRSS``, ``VmHWM``) of /proc/self/status, in bytes."""
    text = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith(field + ":"))) * 1024


def rank(rank: int, port: int, args: argparse.Namespace) -> None:
    """One rank: its RSS before `load_trainable` and its peak across it, into ``args.out``."""
    import torch  # noqa: PLC0415 (the rank's own repo, by PYTHONPATH)

    from areal_agents.config import PPOConfig  # noqa: PLC0415
    from areal_agents.trainers.distributed import DataParallel  # noqa: PLC0415
    from areal_agents.trainers.policy import load_trainable  # noqa: PLC0415
    from areal_agents.trainers.policy_api import TrainSpec  # noqa: PLC0415

    os.environ |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    dp = DataParallel.from_env(torch.device("cpu"))
    ppo = PPOConfig(device="cpu", kl_coef=0.1 if args.kl else 0.0, advantage="gae" if args.gae else "grpo")
    try:
        dp.sum({"ready": 1.0})  # both ranks up before either measures
        before = status_bytes("VmRSS")
        load_trainable("policy", TrainSpec(ppo, 1.0, 0, "float32", 1), args.model_dir, args.model_dir, dp)
        peak = status_bytes("VmHWM")
        Path(args.out, f"rank{rank}.json").write_text(json.dumps({"before": before, "peak": peak}))
    finally:
        dp.close()


def ranks(args: argparse.Namespace) -> None:
    """Two ranks in spawned processes (this process: one loader's pair)."""
    import torch.multiprocessing as mp  # noqa: PLC0415

    from areal_agents.net import free_port  # noqa: PLC0415

    mp.spawn(rank, args=(free_port("127.0.0.1"), args), nprocs=2)


def measure(repo: Path, args: argparse.Namespace, flags: list[str]) -> list[dict]:
    """Each rank's RSS figures of the pair running ``repo``'s code."""
    out = Path(tempfile.mkdtemp(prefix="rank_load_rss_"))
    command = [sys.executable, __file__, str(args.model_dir), "--ranks", "--out", str(out), *flags]
    subprocess.run(command, env=os.environ | {"PYTHONPATH": str(repo)}, check=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--before-repo", type=Path, help="a checkout of the loader to compare with")
    parser.add_argument("--kl", action="store_true", help="ppo.kl_coef > 0: the reference model too")
    parser.add_argument("--gae", action="store_true", help="ppo.advantage=gae: the critic too")
    parser.add_argument("--ranks", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model_dir = str(args.model_dir.resolve())
    if args.ranks:
        ranks(args)
        return
    flags = [f for f, on in (("--kl", args.kl), ("--gae", args.gae)) if on]
    size = sum(p.stat().st_size for p in Path(args.model_dir).glob("*.safetensors"))
    print(f"model weights: {size / GIB:.2f} GiB; models per rank: {1 + args.kl + args.gae}")
    results = {"before": measure(args.before_repo, args, flags), "after": measure(ROOT, args, flags)}
    for label, figures in results.items():
        for r, f in enumerate(figures):
            rise = f["peak"] - f["before"]
            print(
                f"{label:6} rank {r}: RSS {f['before'] / GIB:.2f} GiB before the load, peak {f['peak'] / GIB:.2f} GiB, "
                f"rise {rise / GIB:.2f} GiB ({rise / size:.2f}x the weights)"
            )
    for r in range(2):
        after, before = (results[k][r]["peak"] - results[k][r]["before"] for k in ("after", "before"))
        print(f"rank {r}: load's rise after / before = {after / before:.2f}")


if __name__ == "__main__":
    main()
