"""The device check of issue 30 (item 8): six capped parts on one GPU, PASS/FAIL lines, a JSON file kept as it goes.

    bash scripts/gpu_check.sh                   # on the GPU machine: the carried wheels, then this driver
    bash scripts/gpu_check.sh --cpu-rehearsal   # here: a small model, the same code paths on the CPU

Parts (one function each, run in the order a, b, d, e, t, c, each under its own cap in seconds: past it the rest of
the part is skipped, and said so; a part stuck past its cap by `HARD_GRACE_S` is interrupted; a part cut short
is closed and its threads joined before the next starts; the caps' sum bounds them all, so an overrun comes
out of the later parts' caps):

a. the bf16 matmul peak (one 8192^3 product, warm-up, CUDA-event timing), then PPO steps of the trainer a
   run opens (`open_policy`: FSDP2, bf16 compute) on the qwen3-0.4b model: tokens/s, MFU against that peak
b. `HFEngine` on the GPU at 64 and 256 concurrent requests against `model.generate` one request at a time
c. the single-GPU recipe (examples/gpu): a quick SFT, then RL steps; the slope of each step's accuracy on fresh
   problems, with a 95% interval (bench/gpu_check_stats.py), and held-out accuracy before and after
d. weight sync seconds for the 0.44B model: in_process (the hf engine) against disk (a serve-model server)
e. ``mismatch_kl`` of the update: the GPU engine's behavior logprobs against the trainer's, same weights
t. serve-tinker on the GPU (bench/gpu_check_tinker.py): a LoRA training model's loss falls, and its sampler's
   logprobs on the service's engine match the trainer's forward

Every result is appended to ``OUT/gpu_check.json`` (``$OUT``, else ``--out``) the moment it is known, so a
run killed by its time limit still leaves what it measured. Exit code 0 only when no line FAILed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "gpu"
PARTS = "abdetc"  # c, the longest and the most likely to hit its cap, last


@dataclass(frozen=True)
class Sizes:
    """What differs between the device run and the CPU rehearsal; the code paths do not."""

    preset: str  # tiny-model preset of parts a, b, d, e
    model_kwargs: dict[str, int]  # overrides of the preset's shape
    recipe_preset: str  # model of part c (the recipe)
    matmul_n: int  # the peak's square product
    ppo_groups: int  # GRPO groups of the timed PPO step
    group_size: int
    prompt_tokens: int
    completion_tokens: int
    concurrency: tuple[int, ...]  # HFEngine's concurrent requests
    baseline_requests: int  # model.generate, one at a time
    new_tokens: int  # tokens per request in part b
    sft_steps: int
    sft_overrides: tuple[str, ...]  # of examples/gpu/sft.yaml
    rl_steps: int
    rl_overrides: tuple[str, ...]  # of examples/gpu/rl.yaml
    eval_problems: int
    sync_repeats: int
    caps: dict[str, float]  # seconds per part
    min_mfu: float  # part a passes at this MFU (the target on a GPU)
    max_in_process_sync_s: float  # part d passes at this in_process time


GPU = Sizes(
    preset="qwen3-0.4b",
    model_kwargs={},
    recipe_preset="qwen3-0.4b",
    matmul_n=8192,
    ppo_groups=8,
    group_size=8,
    prompt_tokens=128,
    completion_tokens=896,
    concurrency=(64, 256),
    baseline_requests=16,
    new_tokens=64,
    sft_steps=300,
    sft_overrides=(),
    rl_steps=100,  # as many as part c's cap leaves time for (max_train_minutes): the slope needs steps
    rl_overrides=(),
    eval_problems=200,
    sync_repeats=3,
    caps={"a": 55, "b": 40, "d": 35, "e": 20, "t": 20, "c": 100},  # 270 s: with start-up, inside gpu_check.sh's 300
    min_mfu=0.30,
    max_in_process_sync_s=0.5,
)
CPU = Sizes(
    preset="qwen3-0.4b",  # the same architecture, shrunk
    model_kwargs={"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
    recipe_preset="tiny",
    matmul_n=512,
    ppo_groups=2,
    group_size=4,
    prompt_tokens=16,
    completion_tokens=48,
    concurrency=(8, 32),
    baseline_requests=4,
    new_tokens=16,
    sft_steps=400,
    sft_overrides=("lr=1e-3", "warmup_steps=10"),  # examples/arithmetic's, tuned for the tiny model
    rl_steps=30,
    rl_overrides=("ppo.lr=1e-4",),
    eval_problems=100,
    sync_repeats=2,
    caps={"a": 60, "b": 60, "c": 300, "d": 90, "e": 30, "t": 60},
    min_mfu=0.0,  # a CPU has no bf16 tensor-core peak to reach: the figures must exist, that is all
    max_in_process_sync_s=5.0,
)


class PartCapped(Exception):
    """A part ran past its cap; the message says what was skipped."""


class HardCap(BaseException):
    """A part ran past its cap plus `HARD_GRACE_S`: raised by SIGALRM wherever the part was (a BaseException,
    so no ``except Exception`` on the way swallows it)."""


REST = "the rest of the part skipped"
HARD_GRACE_S = 30.0  # after a part's cap, how long its current piece of work may finish before it is interrupted


CLEANUP_S = 20.0  # after a part: its closers; after a cut one also the shared trainer, the loop, its threads


class Cap:
    """A part's deadline: `check` before each piece of work that may be skipped; `closing` registers what the
    part opened, closed when it ends however it ends."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.end = seconds, time.monotonic() + seconds
        self.closers: list[Callable[[], Any]] = []

    def closing(self, close: Callable[[], Any]) -> None:
        """Call ``close`` when the part ends (the last registered first, as nested ``finally`` blocks)."""
        self.closers.append(close)

    def left(self) -> float:
        return self.end - time.monotonic()

    def check(self, what: str) -> None:
        if self.left() <= 0:
            raise PartCapped(f"past its {self.seconds:.0f}s cap: {what} and {REST}")


class Report:
    """PASS/FAIL/SKIP/INFO lines on stdout, and every record appended to a JSON list rewritten whole each time
    (a valid file whenever the run stops)."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path, self.records, self.failed = path, [], 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self.add("meta", "INFO", "environment", **meta)

    def add(self, part: str, status: str, name: str, **values: Any) -> None:
        if status not in ("PASS", "FAIL", "SKIP", "INFO"):
            raise ValueError(f"status: expects PASS, FAIL, SKIP or INFO, got {status!r}")
        self.failed += status == "FAIL"
        record = {"part": part, "status": status, "name": name, "t": round(time.time(), 1), **values}
        self.records.append(record)
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in values.items())
        print(f"{status} {part}. {name} {shown}".rstrip(), flush=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.records, indent=1, default=str))
        tmp.replace(self.path)

    def check(self, part: str, name: str, ok: bool, **values: Any) -> None:
        self.add(part, "PASS" if ok else "FAIL", name, **values)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def run_part(
    report: Report, part: str, cap_s: float, fn: Callable[[Cap], None], reset: Callable[[], None] | None = None
) -> None:
    """``fn(cap)``; a cap reached is a SKIP line, an exception a FAIL line with its last frames. Then the part's
    closers run; a part cut short (capped or failed) also gets ``reset`` (the shared trainer closed, a new event
    loop) and the threads it started are joined, so none runs on into the next part (`close_part`)."""
    start, before, cap = time.monotonic(), set(threading.enumerate()), Cap(cap_s)
    cut = True
    try:
        with _alarm(cap_s + HARD_GRACE_S, f"past its cap by {HARD_GRACE_S:.0f}s: interrupted mid-way, {REST}"):
            fn(cap)
        cut = False
    except (PartCapped, HardCap) as e:
        report.add(part, "SKIP", "cap", reason=str(e))
    except Exception as e:  # noqa: BLE001  (any failure of a part is a FAIL line; the other parts still run)
        tail = traceback.format_exc().strip().splitlines()[-6:]
        report.add(part, "FAIL", "error", error=f"{type(e).__name__}: {e}", traceback=tail)
    close_part(report, part, cap.closers, reset if cut else None, before if cut else None)
    report.add(part, "INFO", "seconds", seconds=round(time.monotonic() - start, 1), cap=cap_s)


def close_part(
    report: Report,
    part: str,
    closers: list[Callable[[], Any]],
    reset: Callable[[], None] | None,
    before: set[threading.Thread] | None,
) -> None:
    """The closers (each one, last first), then ``reset``, all within `CLEANUP_S`; with ``before`` (the
    threads alive when the part started), a join of those it started until `CLEANUP_S` is spent: one still
    alive is a FAIL line naming it (Python cannot stop a thread from outside)."""
    deadline = time.monotonic() + CLEANUP_S
    for close in [*reversed(closers), *([reset] if reset else [])]:
        try:
            with _alarm(max(deadline - time.monotonic(), 0.01), f"closing took over {CLEANUP_S:.0f}s"):
                close()
        except (Exception, HardCap) as e:  # noqa: BLE001  (the next closer still runs)
            report.add(part, "FAIL", "cleanup", error=f"{type(e).__name__}: {e}", closer=getattr(close, "__name__", ""))
    if before is None:
        return
    started = [t for t in threading.enumerate() if t not in before]
    for t in started:
        t.join(timeout=max(deadline - time.monotonic(), 0.0))
    left = sorted(t.name for t in started if t.is_alive())
    if left:
        report.add(part, "FAIL", "threads_left", threads=left, reason="still running after the part was cut")
    elif started:
        report.add(part, "INFO", "threads_stopped", threads=sorted(t.name for t in started))


@contextmanager
def _alarm(seconds: float, message: str) -> Iterator[None]:
    """`HardCap` (``message``) raised wherever the block is after ``seconds``; the old SIGALRM handler after."""

    def stop(signum: int, frame: Any) -> None:
        raise HardCap(message)

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def renew_loop(loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
    """Cancel what a cut part left on ``loop``, stop its executor's threads, close it; a fresh loop."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    try:
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()
    return asyncio.new_event_loop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-rehearsal", action="store_true", help="a small model on the CPU: the same paths")
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check", help="default: $OUT")
    parser.add_argument("--work", default=None, help="where a fresh work directory goes (default: the temp dir)")
    parser.add_argument("--parts", default=PARTS, help=f"which parts, e.g. 'ad' (default {PARTS})")
    parser.add_argument("--cap-scale", type=float, default=1.0, help="multiply every part's cap")
    args = parser.parse_args(argv)
    if not args.parts or set(args.parts) - set(PARTS) or len(set(args.parts)) < len(args.parts):
        parser.error(f"--parts: expects distinct letters of {PARTS!r}, got {args.parts!r}")
    if args.cap_scale <= 0:
        parser.error(f"--cap-scale: expects a positive number, got {args.cap_scale}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = CPU if args.cpu_rehearsal else GPU
    out = Path(args.out)
    import torch  # noqa: PLC0415  (after argument errors, which need no torch)

    from areal_agents.models.loading import quiet_transformers  # noqa: PLC0415

    quiet_transformers()
    if not args.cpu_rehearsal and not torch.cuda.is_available():
        print("FAIL meta. no GPU: torch.cuda.is_available() is False (use --cpu-rehearsal off a GPU)", flush=True)
        return 1
    device = torch.device("cpu") if args.cpu_rehearsal else torch.device("cuda", 0)  # set_device wants an index
    report = Report(out / "gpu_check.json", environment(device, sizes))
    # models, run dirs and checkpoints (GBs) stay out of OUT: the device tool brings back 8 files of it at most
    work = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=args.work))
    report.add("meta", "INFO", "work_dir", path=str(work))
    ctx = Context(sizes, device, work, report, asyncio.new_event_loop())
    import gpu_check_parts as parts  # noqa: PLC0415  (bench/ is on sys.path when this script runs)

    caps = {part: sizes.caps[part] * args.cap_scale for part in args.parts}
    end = time.monotonic() + sum(caps.values())  # a part's overrun (grace, clean-up) comes out of the later ones
    for part in args.parts:
        cap_s = min(caps[part], end - time.monotonic())
        if cap_s <= 0:
            report.add(part, "SKIP", "budget", reason=f"the parts' {sum(caps.values()):.0f}s are spent")
            continue
        fn = parts.PART[part]
        run_part(report, part, cap_s, lambda cap, f=fn: f(ctx, cap), lambda: reset(ctx))
    parts.finish(ctx)
    ctx.loop.close()
    verdict = "all passed" if not report.failed else f"{report.failed} FAILED"
    print(f"gpu_check: {verdict} ({out / 'gpu_check.json'})", flush=True)
    return 0 if not report.failed else 1


def reset(ctx: Context) -> None:
    """After a cut part: the shared trainer and its engine closed (the next part that needs them opens them
    again), and a new event loop in place of one the part may have left tasks on."""
    import gpu_check_parts as parts  # noqa: PLC0415

    try:
        parts.finish(ctx)
    finally:
        ctx.loop = renew_loop(ctx.loop)


@dataclass
class Context:
    """What the parts share: sizes, device, a work directory, the report and one event loop."""

    sizes: Sizes
    device: Any
    work: Path
    report: Report
    loop: asyncio.AbstractEventLoop
    measured_peak_tflops: float | None = None  # part a's, for part a's MFU
    model_dir: Path | None = None  # the preset model, built once
    policy: Any = None  # the run's trainer and its in-process engine, shared by parts a, d and e


def environment(device: Any, sizes: Sizes) -> dict[str, Any]:
    """Versions, the device and the sizes, as the first record."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    meta = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "transformers_file": transformers.__file__,
        "device": str(device),
        "sizes": asdict(sizes),
    }
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["cuda"] = torch.version.cuda
    try:
        meta["git"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        meta["git"] = "unknown"
    return meta


if __name__ == "__main__":
    sys.path.insert(1, str(ROOT))  # the working tree's areal_agents (gpu_check.sh sets PYTHONPATH too)
    sys.exit(main())
