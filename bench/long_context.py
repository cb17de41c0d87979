"""Long reasoning traces: peak memory and tokens/s against length, for every trainer path and the engine.

    .venv/bin/python bench/long_context.py [--lengths 1024,2048,4096,8192,16384] [--long 32768]
                                           [--engine-lengths 1024,2048,4096,8192,16384] [--updates 200]

Trainer: one PPO update (`ppo_update`, GRPO) of one group of ``--group`` trajectories of L tokens that
share a ``--prompt``-token prompt, on a tiny Llama (``--hidden`` x ``--layers``, ``max_position_embeddings``
32768), one micro-batch, for each path: packed, packed with shared prompts (the default), padded, each
with activation checkpointing off and on. ``--long`` adds the checkpointed packed paths at that length
(a 32K-token group in one update). Engine: `HFEngine` generating one answer of L tokens (``ignore_eos``).
Each measurement runs in a fresh process with ``MALLOC_MMAP_THRESHOLD_=1048576`` (so RSS follows live
tensors: with glibc's adaptive threshold, peaks came out up to 2.6x higher and non-monotone); memory is
the peak RSS above the process's RSS just before the update (the kernel's high-water mark, reset there).
Time is the best of ``--repeats`` updates (default 3 up to 4096 tokens, else 1). Per path it prints
the memory exponent fitted over ``--lengths`` (1.0 = linear; the target is <= 1.05) and, per L, shared
prompts' memory and time against plain packing's. Last, ``--updates`` updates of varied lengths (shared
prompts) in one process: RSS after all of them against RSS after a tenth
(target: within 10%; anything cached per batch would grow it). ``--only alternate`` times shared prompts
against packing alternated in one process, the fair ratio where separate processes' times scatter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MMAP_THRESHOLD = "1048576"
TRAIN_PATHS = {  # name: (packing, share_prompts)
    "packed": (True, False),
    "shared prompts": (True, True),
    "padded": (False, False),
}


# ---- measured in a child process -------------------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark of this process (``VmHWM``); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_mb(reset: bool) -> float:
    if reset:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def group(length: int, prompt: int, members: int, rng: random.Random) -> list:
    """A GRPO group: ``members`` trajectories of ``length`` tokens sharing a ``prompt``-token prompt, rewards 0..1."""
    from areal_agents.types import Trajectory

    head = [rng.randrange(4, 90) for _ in range(prompt)]
    out = []
    for k in range(members):
        ids = head + [rng.randrange(4, 90) for _ in range(length - prompt)]
        mask = [0] * prompt + [1] * (length - prompt)
        out.append(Trajectory(ids, mask, [-4.5] * length, [0] * length, reward=k / max(1, members - 1), group_id="g"))
    return out


def train_child(args: argparse.Namespace) -> dict:
    """Peak memory above the start and tokens/s of one PPO update of one group of ``args.length`` tokens."""
    import torch

    from areal_agents.config import PPOConfig
    from areal_agents.models import load_model
    from areal_agents.trainers.optim import make_optimizer
    from areal_agents.trainers.ppo import ppo_update

    torch.manual_seed(0)
    packing, share = TRAIN_PATHS[args.path]
    model = load_model(args.model)
    if args.checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    cfg = PPOConfig(
        packing=packing,
        share_prompts=share,
        micro_batch_tokens=args.group * args.length,
        filter_zero_variance_groups=False,
        behav_imp_weight_cap=None,
    )
    optimizer, scheduler = make_optimizer(model, cfg.lr, 0.0, 0)
    warm = group(args.prompt + 16, args.prompt, args.group, random.Random(1))  # first-step costs: optimizer state
    ppo_update(model, optimizer, scheduler, warm, cfg, temperature=1.0, pad_token_id=0)
    trajs = group(args.length, args.prompt, args.group, random.Random(0))
    reset = reset_peak()
    start_rss = rss_mb()
    seconds = math.inf
    for _ in range(args.repeats or (3 if args.length <= 4096 else 1)):  # time: the best of a few short ones
        start = time.perf_counter()
        ppo_update(model, optimizer, scheduler, trajs, cfg, temperature=1.0, pad_token_id=0)
        seconds = min(seconds, time.perf_counter() - start)
    return {"mb": peak_mb(reset) - start_rss, "s": seconds, "tokens_per_s": args.group * args.length / seconds}


def engine_child(args: argparse.Namespace) -> dict:
    """Peak memory above the start and tokens/s of `HFEngine` generating one ``args.length``-token answer."""
    import asyncio

    from areal_agents.engines import HFEngine
    from areal_agents.models import load_model
    from areal_agents.types import GenRequest, SamplingParams

    engine = HFEngine(load_model(args.model), num_threads=1, prefix_cache_tokens=0, seed=0)
    prompt = [random.Random(0).randrange(4, 90) for _ in range(args.prompt)]
    warm = GenRequest("warm", prompt, SamplingParams(8, ignore_eos=True))
    asyncio.run(engine.agenerate(warm))
    request = GenRequest("long", prompt, SamplingParams(args.length, ignore_eos=True))
    reset = reset_peak()
    start_rss = rss_mb()
    start = time.perf_counter()
    response = asyncio.run(engine.agenerate(request))
    seconds = time.perf_counter() - start
    engine.close()
    assert len(response.output_tokens) == args.length, (len(response.output_tokens), response.stop_reason)
    return {"mb": peak_mb(reset) - start_rss, "s": seconds, "tokens_per_s": args.length / seconds}


def drift_child(args: argparse.Namespace) -> dict:
    """RSS after a tenth of ``args.updates`` updates of varied lengths, and after all of them."""
    import torch

    from areal_agents.config import PPOConfig
    from areal_agents.models import load_model
    from areal_agents.trainers.optim import make_optimizer
    from areal_agents.trainers.ppo import ppo_update

    torch.manual_seed(0)
    model = load_model(args.model)
    model.train()
    cfg = PPOConfig(micro_batch_tokens=8192, filter_zero_variance_groups=False)
    optimizer, scheduler = make_optimizer(model, cfg.lr, 0.0, 0)
    rng = random.Random(0)
    rss, start = {}, time.perf_counter()
    for step in range(1, args.updates + 1):
        trajs = group(rng.randrange(64, 1024), rng.randrange(8, 64), 4, rng)
        ppo_update(model, optimizer, scheduler, trajs, cfg, temperature=1.0, pad_token_id=0)
        if step in (args.updates // 10, args.updates):
            rss[step] = rss_mb()
    return {"rss": rss, "s": time.perf_counter() - start}


def alternate_child(args: argparse.Namespace) -> dict:
    """Seconds of a packed and a shared-prompt update of one ``args.length`` group, alternated in one process
    (``args.repeats`` rounds after a warm-up one; medians): a fair time ratio on a noisy machine."""
    import statistics

    from areal_agents.config import PPOConfig
    from areal_agents.models import load_model
    from areal_agents.trainers.optim import make_optimizer
    from areal_agents.trainers.ppo import ppo_update

    model = load_model(args.model)
    model.train()
    trajs = group(args.length, args.prompt, args.group, random.Random(0))
    times: dict[str, list[float]] = {"packed": [], "shared prompts": []}
    for round_ in range(1 + (args.repeats or 5)):
        for name in times:
            cfg = PPOConfig(
                share_prompts=name == "shared prompts", micro_batch_tokens=args.group * args.length,
                filter_zero_variance_groups=False, behav_imp_weight_cap=None,
            )  # fmt: skip
            optimizer, scheduler = make_optimizer(model, cfg.lr, 0.0, 0)
            start = time.perf_counter()
            ppo_update(model, optimizer, scheduler, trajs, cfg, temperature=1.0, pad_token_id=0)
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


CHILDREN = {"train": train_child, "engine": engine_child, "drift": drift_child, "alternate": alternate_child}


# ---- the driver ------------------------------------------------------------------------------------


def measure(kind: str, model: Path, **options: object) -> dict:
    """Run one measurement in a fresh process (its own allocator state and peak) and return its result."""
    cmd = [sys.executable, __file__, "--child", kind, "--model", str(model)]
    for key, value in options.items():
        if value is True:
            cmd.append(f"--{key}")
        elif value is not False:
            cmd += [f"--{key}", str(value)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def exponent(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(memory) against log(length)."""
    xs, ys = [math.log(n) for n, _ in points], [math.log(max(m, 1e-3)) for _, m in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def show(name: str, length: int, r: dict) -> None:
    if "error" in r:
        print(f"{name:34s} L={length:6d}: failed: {r['error']}", flush=True)
    else:
        print(
            f"{name:34s} L={length:6d}: {r['mb']:8.0f} MB  {r['s']:7.1f} s  {r['tokens_per_s']:7.0f} tokens/s",
            flush=True,
        )


def bench_trainer(args: argparse.Namespace, model: Path) -> None:
    print(f"== trainer: one GRPO group of {args.group} x L tokens, a {args.prompt}-token shared prompt ==")
    results: dict[str, dict[int, dict]] = {}
    for path in args.paths.split(","):
        for checkpointing in (False, True):
            name = f"{path}{', checkpointing' if checkpointing else ''}"
            lengths = args.lengths + ([args.long] if args.long and checkpointing and path != "padded" else [])
            results[name] = {}
            for n in lengths:
                r = measure(
                    "train", model, path=path, length=n, group=args.group, prompt=args.prompt,
                    checkpointing=checkpointing, repeats=args.repeats,
                )  # fmt: skip
                results[name][n] = r
                show(name, n, r)
    print(f"-- memory exponent over L = {args.lengths[0]}..{args.lengths[-1]} (target <= 1.05) --")
    for name, by_length in results.items():
        points = [(n, by_length[n]["mb"]) for n in args.lengths if "mb" in by_length.get(n, {})]
        if len(points) >= 2:
            print(f"{name:34s} exponent {exponent(points):.2f}")
    print("-- shared prompts vs packed (memory, time; target <= 1.00 both) --")
    for suffix in ("", ", checkpointing"):
        shared, packed = results.get(f"shared prompts{suffix}", {}), results.get(f"packed{suffix}", {})
        for n in args.lengths:
            if "mb" in shared.get(n, {}) and "mb" in packed.get(n, {}):
                mem, sec = shared[n]["mb"] / packed[n]["mb"], shared[n]["s"] / packed[n]["s"]
                print(f"shared/packed{suffix:16s} L={n:6d}: memory {mem:.2f}x, time {sec:.2f}x")


def bench_engine(args: argparse.Namespace, model: Path) -> None:
    print(f"== engine: HFEngine generating one answer of L tokens after a {args.prompt}-token prompt ==")
    points = []
    for n in args.engine_lengths:
        r = measure("engine", model, length=n, prompt=args.prompt)
        show("HFEngine generation", n, r)
        if "mb" in r:
            points.append((n, r["mb"]))
    if len(points) >= 2:
        print(f"{'HFEngine generation':34s} exponent {exponent(points):.2f}")


def bench_drift(args: argparse.Namespace, model: Path) -> None:
    r = measure("drift", model, updates=args.updates)
    if "error" in r:
        print(f"== drift == failed: {r['error']}")
        return
    (early, a), (late, b) = sorted((int(k), v) for k, v in r["rss"].items())
    print(
        f"== RSS over {args.updates} updates of varied lengths (a group of 4, 64..1024 tokens, shared prompts) ==\n"
        f"after {early}: {a:.0f} MB, after {late}: {b:.0f} MB = {b / a:.3f}x (target <= 1.10), {r['s']:.0f} s"
    )


def bench_alternate(args: argparse.Namespace, model: Path) -> None:
    print(f"== shared prompts vs packed, alternated in one process ({args.repeats or 5} rounds, medians) ==")
    for n in args.lengths:
        r = measure("alternate", model, length=n, group=args.group, prompt=args.prompt, repeats=args.repeats)
        if "error" in r:
            print(f"L={n:6d}: failed: {r['error']}")
        else:
            shared, packed = r["shared prompts"], r["packed"]
            print(f"L={n:6d}: packed {packed:6.2f} s, shared prompts {shared:6.2f} s = {shared / packed:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--lengths", type=ints, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--long", type=int, default=32768, help="checkpointed packed paths also at this L (0: none)")
    parser.add_argument("--engine-lengths", type=ints, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--updates", type=int, default=200, help="updates of the RSS drift check (0: skip)")
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--paths", default=",".join(TRAIN_PATHS), help="trainer paths to run, comma-separated")
    parser.add_argument("--repeats", type=int, default=0, help="updates timed per L (0: 3 up to 4096 tokens, else 1)")
    parser.add_argument("--only", choices=["trainer", "engine", "drift", "alternate"], default=None)
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=sorted(TRAIN_PATHS), help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch
        import transformers

        transformers.utils.logging.set_verbosity_error()
        torch.set_num_threads(os.cpu_count() or 1)
        print(json.dumps(CHILDREN[args.child](args)))
        return
    import transformers

    from areal_agents.models import save_tiny_model

    transformers.utils.logging.disable_progress_bar()

    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        model = save_tiny_model(
            tmp, hidden_size=args.hidden, num_layers=args.layers, intermediate_size=2 * args.hidden,
            max_position_embeddings=max([32768, args.long, *args.lengths, *args.engine_lengths]),
        )  # fmt: skip
        print(f"== bench/long_context == tiny Llama {args.hidden} x {args.layers} layers, {os.cpu_count()} CPUs")
        if args.only in (None, "trainer"):
            bench_trainer(args, model)
        if args.only in (None, "engine"):
            bench_engine(args, model)
        if args.only in (None, "drift") and args.updates:
            bench_drift(args, model)
        if args.only == "alternate":
            bench_alternate(args, model)


if __name__ == "__main__":
    main()
