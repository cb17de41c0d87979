"""Asynchronous vs synchronous RL: trained samples/s at max_staleness 0 (sync) vs 1, 2, 4, same run.

    .venv/bin/python bench/async_vs_sync.py --simulate          # a GPU-cluster latency model, no real model
    .venv/bin/python bench/async_vs_sync.py --sft-model runs/count/sft/model   # a real recipe on this CPU
    .venv/bin/python bench/async_vs_sync.py --task arithmetic --sft-model runs/arith/sft/model --max-turns 1

Real mode: a recipe from the same SFT checkpoint, seed and prompts at each max_staleness, each in a
fresh process, with 1.5x the engine's running requests in flight (the staleness gate permitting); prints
end-to-end samples/s over the training steps and the held-out accuracy after. ``--repeats N`` runs
every setting N times, the settings alternating, and prints medians (runs here vary by 10-20%, the
synchronous ones most: their two-thread teams suffer most when the host is busy).
``--task count`` (examples/count/rl.yaml): answers of long-tailed length (1 to 32 numbers, median 6), the
case the target is set for: >= 1.5x samples/s with accuracy within 5 points. ``--task arithmetic``
(examples/arithmetic/rl.yaml): answers of 2-4 characters, with multi-turn retries (``--max-turns`` 4: a
wrong answer gets feedback and another turn; 1 is the one-turn recipe).

Simulation: the real `RolloutController` drives a simulated inference cluster. Decoding advances every
running sequence one token per step, and a step takes ``step_ms + per_seq_ms * running`` (memory-bound
decoding: a fuller batch costs little more); output lengths are long-tailed (log-normal, capped);
a training step takes ``train_s`` and a weight update ``sync_s``, during which decoding is paused and
interrupted requests resume with the new version. Sync (max_staleness 0) idles the cluster while it
trains and while the longest sequence of a batch finishes; async keeps it busy. Target (issue 7): >= 2.5x.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import random
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from areal_agents.engines.base import InferenceEngine
from areal_agents.rollout.controller import RolloutController
from areal_agents.types import GenRequest, GenResponse, SamplingParams, Trajectory


def virtual_time_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose clock jumps to the next timer instead of waiting: simulated seconds cost nothing."""
    loop = asyncio.new_event_loop()
    clock = [0.0]
    select = loop._selector.select  # noqa: SLF001

    def jump(timeout=None):  # noqa: ANN001
        if timeout is not None and timeout > 0:
            clock[0] += timeout
        return select(0)

    loop._selector.select = jump  # noqa: SLF001
    loop.time = lambda: clock[0]
    return loop


class SimulatedCluster(InferenceEngine):
    """An `InferenceEngine` with a latency model instead of a model: one token per running sequence per step."""

    def __init__(self, step_ms: float, per_seq_ms: float, sync_s: float) -> None:
        self.step_s, self.per_seq_s, self.sync_s = step_ms / 1000, per_seq_ms / 1000, sync_s
        self.version = 0
        self.running: dict[int, list] = {}
        self.paused = asyncio.Event()
        self.paused.set()
        self.busy_steps = 0
        self.occupancy = 0  # running sequences summed over decode steps
        self._ids = itertools.count()
        self._loop_task: asyncio.Task | None = None
        self._work = asyncio.Event()

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    async def agenerate(self, request: GenRequest) -> GenResponse:
        if self._loop_task is None:
            self._loop_task = asyncio.ensure_future(self._decode_loop())
        done = asyncio.get_running_loop().create_future()
        self.running[next(self._ids)] = [request.sampling.max_new_tokens, [], done]
        self._work.set()
        versions = await done
        return GenResponse([0] * len(versions), [0.0] * len(versions), versions, "length")

    async def _decode_loop(self) -> None:
        while True:
            await self.paused.wait()
            if not self.running:
                self._work.clear()
                await self._work.wait()
                continue
            await asyncio.sleep(self.step_s + self.per_seq_s * len(self.running))
            self.busy_steps += 1
            self.occupancy += len(self.running)
            for key, (remaining, versions, done) in list(self.running.items()):
                versions.append(self.version)
                if len(versions) >= remaining:
                    del self.running[key]
                    done.set_result(versions)

    async def pause(self) -> None:
        self.paused.clear()

    async def resume(self) -> None:
        self.paused.set()

    async def update_weights(self, state_dict, version=None) -> None:  # noqa: ANN001
        await self.pause()
        await asyncio.sleep(self.sync_s)
        self.version += 1
        await self.resume()


class LongTailAgent:
    """One single-turn episode whose output length is drawn from a capped log-normal."""

    def __init__(self, engine, rng: random.Random, median: int, sigma: float, cap: int) -> None:
        self.engine, self.rng, self.median, self.sigma, self.cap = engine, rng, median, sigma, cap
        self.tokens = 0

    async def run_episode(self, env, *, seed, episode_id):  # noqa: ANN001
        n = max(1, min(self.cap, int(self.median * self.rng.lognormvariate(0, self.sigma))))
        r = await self.engine.agenerate(GenRequest(episode_id, [1], SamplingParams(n)))
        self.tokens += n
        return [Trajectory([1, *r.output_tokens], [0] + [1] * n, [0.0] * (n + 1), [-1, *r.output_versions], reward=1.0)]


async def simulate(max_staleness: int, args) -> dict[str, float]:
    engine = SimulatedCluster(args.step_ms, args.per_seq_ms, args.sync_s)
    loop = asyncio.get_running_loop()
    agent = LongTailAgent(engine, random.Random(args.seed), args.median_tokens, args.sigma, args.max_tokens)
    controller = RolloutController(
        agent,
        lambda: None,
        lambda i: i,
        batch_size=args.batch_size,
        group_size=args.group_size,
        get_version=engine.get_version,
        max_staleness=max_staleness,
        max_concurrent_episodes=args.max_concurrent_episodes,
    )
    start = loop.time()
    staleness = []
    for _ in range(args.steps):
        batch = await controller.get_batch()
        staleness += [engine.version - min(v for t in g.trajectories for v in t.versions if v >= 0) for g in batch]
        await asyncio.sleep(args.train_s)  # training: the cluster keeps decoding if async
        await engine.update_weights(None)
        controller.notify_version()
    elapsed = loop.time() - start
    await controller.aclose()
    engine._loop_task.cancel()
    samples = args.steps * args.batch_size * args.group_size
    return {
        "samples_per_s": samples / elapsed,
        "seconds": elapsed,
        "max_staleness_seen": max(staleness),
        "stale_groups": controller.stats.groups_stale,
        "occupancy": engine.occupancy / max(engine.busy_steps, 1),
    }


def train_once(recipe: Path, overrides: list[str]) -> dict:
    """One run of a recipe (in a fresh process: no threads or OpenMP teams of another run)."""
    import transformers  # noqa: PLC0415

    from areal_agents.config import TrainConfig, load_config  # noqa: PLC0415
    from areal_agents.trainers.rl_recipe import run_train  # noqa: PLC0415

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return run_train(load_config(TrainConfig, recipe, overrides), progress=False)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TASKS = {"count": EXAMPLES / "count" / "rl.yaml", "arithmetic": EXAMPLES / "arithmetic" / "rl.yaml"}
LAYOUTS = {
    "thread": [],  # the engine's decode thread, the event loop and the trainer thread in one process
    "processes": ["engine.own_process=true", "ppo.trainer=process"],  # engine and trainer in their own
}


def real(args) -> None:  # noqa: ANN001
    """A recipe at each max_staleness and layout, same checkpoint, seed and prompts."""
    if not args.sft_model:
        raise SystemExit("real mode needs --sft-model (the task's SFT model: see examples/count/run.sh)")
    layouts = args.layouts.split(",")
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        raise SystemExit(f"--layouts: unknown {sorted(unknown)}; choose from {sorted(LAYOUTS)}")
    from areal_agents.config import TrainConfig, load_config  # noqa: PLC0415

    recipe = load_config(TrainConfig, TASKS[args.task], args.set)  # as the runs will see it
    in_flight = recipe.engine.max_running_requests * 3 // 2
    results: dict[tuple[int, str], list[dict]] = {}
    for repeat in range(args.repeats):  # settings alternate: a slow spell of the machine hits each alike
        for eta in [int(x) for x in args.staleness.split(",")]:
            for layout in layouts:
                run_dir = f"{args.out}/staleness{eta}-{layout}" + (f"-{repeat + 1}" if args.repeats > 1 else "")
                overrides = [
                    # episodes in flight: the engine's running requests and half as many queued, to take a row
                    # the moment one frees; a deeper queue only ages requests before their first token, and the
                    # batch then waits for the groups due
                    f"rollout.max_concurrent_rollouts={in_flight}",
                    f"run_dir={run_dir}",
                    f"model.path={args.sft_model}",
                    f"steps={args.rl_steps}",
                    f"rollout.max_staleness={eta}",
                    *([f"env.kwargs.max_turns={args.max_turns}"] if args.task == "arithmetic" else []),
                    *LAYOUTS[layout],
                    *args.set,
                ]
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    run = pool.submit(train_once, TASKS[args.task], overrides).result()
                results.setdefault((eta, layout), []).append(run)
    turns = f", max_turns {args.max_turns}" if args.task == "arithmetic" else ""
    runs = f", median of {args.repeats} runs each" if args.repeats > 1 else ""
    print(f"\n== bench/async_vs_sync ({args.task} recipe, this CPU{turns}{runs}, {' '.join(args.set)}) ==")
    rate = {key: statistics.median(r["samples_per_s"] for r in rs) for key, rs in results.items()}
    accuracy = {key: statistics.median(r["accuracy_after"] for r in rs) for key, rs in results.items()}
    sync = [key for key in results if key[0] == 0] or list(results)
    base = max(sync, key=rate.get)  # the faster synchronous layout
    for (eta, layout), rs in results.items():
        key = (eta, layout)
        each = " (" + ", ".join(f"{r['samples_per_s']:.1f}" for r in rs) + ")" if len(rs) > 1 else ""
        points = 100 * (accuracy[key] - accuracy[base])
        print(
            f"max_staleness {eta} ({layout:9s}): {rate[key]:6.1f} samples/s{each} = {rate[key] / rate[base]:.2f}x the "
            f"faster sync | held-out accuracy {rs[0]['accuracy_before']:.1%} -> {accuracy[key]:.1%} ({points:+.1f} "
            f"points; {rs[0]['steps']} steps, {sum(r['episodes']['rejected'] for r in rs)} episodes dropped as stale)"
        )
    print("where the training steps' time went (medians): the trainer busy, and the engine busy decoding")
    for (eta, layout), rs in results.items():
        trainer = statistics.median(r["train_seconds"] / r["step_seconds"] for r in rs)
        busy = [r["engine_busy_fraction"] for r in rs if r.get("engine_busy_fraction") is not None]
        engine = f", engine busy {statistics.median(busy):.0%}" if busy else ""
        print(f"max_staleness {eta} ({layout:9s}): trainer busy {trainer:.0%}{engine}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true", help="the GPU-cluster latency model (no real model)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-concurrent-episodes", type=int, default=1024)
    parser.add_argument("--median-tokens", type=int, default=2000)
    parser.add_argument("--sigma", type=float, default=0.8, help="log-normal spread of output lengths")
    parser.add_argument("--max-tokens", type=int, default=16000)
    parser.add_argument("--step-ms", type=float, default=25.0, help="decode step time at batch 0 (ms)")
    parser.add_argument("--per-seq-ms", type=float, default=0.02, help="decode step time per running sequence (ms)")
    parser.add_argument("--train-s", type=float, default=60.0, help="seconds per training step")
    parser.add_argument("--sync-s", type=float, default=5.0, help="seconds per weight update")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-model", default="", help="real mode: the task's SFT checkpoint")
    parser.add_argument("--rl-steps", type=int, default=100, help="real mode: RL steps per setting")
    parser.add_argument("--staleness", default="0,4", help="real mode: max_staleness values, comma-separated")
    parser.add_argument("--task", choices=sorted(TASKS), default="count", help="real mode: the recipe")
    parser.add_argument("--max-turns", type=int, default=4, help="real mode, arithmetic: turns per episode")
    parser.add_argument(
        "--repeats", type=int, default=1, help="real mode: runs of each setting, alternated; medians are printed"
    )
    parser.add_argument("--out", default="runs/bench_async", help="real mode: run directories")
    parser.add_argument("--set", action="append", default=[], help="real mode: a config override for every setting")
    parser.add_argument(
        "--layouts",
        default="thread,processes",
        help="real mode: 'thread' (engine, event loop and trainer in one process) and/or 'processes' "
        "(engine.own_process=true ppo.trainer=process)",
    )
    args = parser.parse_args()
    if not args.simulate:
        return real(args)
    print("== bench/async_vs_sync (simulated cluster) ==")
    print(
        f"{args.batch_size} prompts x {args.group_size} per step, output tokens log-normal median "
        f"{args.median_tokens} (sigma {args.sigma}, cap {args.max_tokens}), train {args.train_s}s/step, "
        f"weight sync {args.sync_s}s"
    )
    results = {}
    for eta in (0, 1, 2, 4):
        loop = virtual_time_loop()
        results[eta] = loop.run_until_complete(simulate(eta, args))
        loop.close()
        r = results[eta]
        ratio = r["samples_per_s"] / results[0]["samples_per_s"]
        print(
            f"max_staleness {eta}: {r['samples_per_s']:7.2f} samples/s  ({r['seconds']:6.0f} simulated s, "
            f"max staleness seen {r['max_staleness_seen']}, {r['stale_groups']} groups dropped as stale, "
            f"{r['occupancy']:.0f} sequences per decode step) = {ratio:.2f}x sync"
        )


if __name__ == "__main__":
    main()
