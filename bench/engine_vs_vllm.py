"""Generated tokens/s of serve-model (our HFEngine behind SGLang's HTTP API) against a vLLM server, same load.

    .venv/bin/python bench/engine_vs_vllm.py [--quick] [--rounds 3] [--new-tokens 32] [--vllm-python PY]

Both servers run the same tiny Llama (the recipes' default: hidden 128, 4 layers, 4 heads of 32) in
float32 and are started once, side by side; each is driven through the client a run uses
(`engine_client` -> `agenerate`), so a figure includes HTTP and the client as a run sees them. Loads: 64
and 256 concurrent requests; one-turn episodes (one request of ``--new-tokens`` sampled tokens each) and
4-turn episodes (each next turn's prompt = the previous prompt + its output + a few "user" tokens, with
the episode's rid prefix, ``ep7/t0``, ``ep7/t1``..., so both servers' prefix caches can reuse the
conversation). Every request generates exactly ``--new-tokens`` tokens (``ignore_eos``), temperature 1.

vLLM runs with the flags a run gives it (`vllm_command`) and vLLM's own CPU defaults otherwise: at most
128 running requests (``--max-num-seqs``; serve-model's ``engine.max_running_requests`` is 256), 2048
tokens a step and 128-token KV blocks, the unit its prefix cache reuses. ``--vllm-args "--max-num-seqs 256
--block-size 32"`` matches serve-model's batch and lets short conversations' blocks be reused. Under each
result line: each server's wall ms per model step, tokens run per step (prefill and decode), the prompt
tokens its prefix cache supplied, and serve-model's share of wall time in engine steps.

vLLM runs with tcmalloc preloaded, as its CPU install guide asks (its worker warns without it; both
engines then keep the memory they free, serve-model through `engines/process_malloc.py`), when the system
has it (Debian: ``apt-get install libtcmalloc-minimal4``; ``--vllm-preload PATH`` names another library,
``--vllm-preload ""`` none); the header says which.

``--hidden`` / ``--layers`` give a wider or deeper model (heads of 32) to see how the ratio moves as the
model's compute grows against the per-step overhead. ``--compile-decode`` runs serve-model's decode step as
compiled graphs (`engines/hf/compiled_decode.py`); the warm-up compiles the row buckets it meets.
``--against eager`` measures it against serve-model without.
``--against glibc-malloc`` measures serve-model against itself with glibc's own malloc policy
(``AREAL_ENGINE_MALLOC=system``: freed memory handed back to the kernel, `engines/process_malloc.py`)
instead of vLLM.

Fairness on a small, shared machine: the measurements alternate (serve-model, vLLM, serve-model, ...,
``--rounds`` of each per load, fresh prompts every round) and the figures are medians; the CPU the idle
server burns while the other one is measured is read from /proc and printed (a busy-polling idle server
would slow the measured one down). vLLM's model worker busy-polls its shared-memory queue for ~1 s after
its last step (``shm_broadcast``'s ``busy_loop_s``), then sleeps: each measurement starts after
``--settle`` seconds of quiet, so neither server spins during the other's.

Core budget: serve-model runs its decode loop with ``cpu_threads=1`` (one torch thread; its HTTP server
shares that process); vLLM's CPU backend, on 2 cores, binds its model worker to one core with one OpenMP
thread and leaves the other to its API server and scheduler processes. Both may use both cores; each
runs its model on one thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import transformers
from engine import prompts_for  # bench/ is on sys.path when this script runs

from areal_agents.config import EngineConfig
from areal_agents.engines.local_servers import ServerGroup, engine_client, launch_servers
from areal_agents.engines.process_malloc import MALLOC_ENV
from areal_agents.models import load_tokenizer, save_tiny_model
from areal_agents.types import GenRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
USER_TOKENS = 8  # the "user" tokens appended to a conversation before its next turn
# vLLM's CPU guide preloads tcmalloc; Debian's libtcmalloc-minimal4 ("" when the system has none)
TCMALLOC = next((str(p) for p in Path("/usr/lib").glob("*/libtcmalloc_minimal.so.4")), "")


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid``."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp, ...; utime, stime at 11, 12
            total += int(fields[11]) + int(fields[12])
    return total / tick


async def server_counters(session, name: str, address: str) -> dict[str, float]:
    """The server's own counters: model steps, tokens run through the model (prefill and decode), prefix-cache
    hit and looked-up tokens (and serve-model's engine-busy seconds), from serve-model's /get_server_info
    or vLLM's Prometheus /metrics."""
    if name.startswith("serve-model"):
        async with session.get(f"{address}/get_server_info") as r:
            stats = (await r.json())["engine"]
        hits = stats["prefix_hit_tokens"]
        return {
            "steps": stats["decode_steps"],
            "tokens": stats["prefill_tokens"] + stats["generated_tokens"],
            "busy": stats["busy_seconds"],
            "hits": hits,
            "looked_up": hits + stats["prefill_tokens"],
        }
    async with session.get(f"{address}/metrics") as r:
        text = await r.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            key, _, value = line.rpartition(" ")
            metric = key.split("{", 1)[0]
            values[metric] = values.get(metric, 0.0) + float(value)
    return {
        "steps": values.get("vllm:iteration_tokens_total_count", math.nan),
        "tokens": values.get("vllm:iteration_tokens_total_sum", math.nan),
        "busy": math.nan,
        "hits": values.get("vllm:prefix_cache_hits_total", math.nan),
        "looked_up": values.get("vllm:prefix_cache_queries_total", math.nan),
    }


async def run_load(client, prompts, turns: int, new_tokens: int, user: list[int], tag: str) -> tuple[int, float]:
    """Run one load on ``client``: (generated tokens, seconds)."""
    sampling = SamplingParams(new_tokens, temperature=1.0, ignore_eos=True)

    async def episode(i: int, context: list[int]) -> int:
        tokens = 0
        for turn in range(turns):
            r = await client.agenerate(GenRequest(f"{tag}-ep{i}/t{turn}", context, sampling))
            tokens += len(r.output_tokens)
            context = context + r.output_tokens + user
        return tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(episode(i, p) for i, p in enumerate(prompts)))
    return sum(counts), time.perf_counter() - start


async def measure(args, tokenizer, servers: dict[str, ServerGroup], clients: dict) -> None:
    rng = random.Random(args.seed)
    user = tokenizer.apply_chat_template([{"role": "user", "content": "x" * 16}], return_dict=False)[:USER_TOKENS]
    names = list(clients)

    # Idle CPU of each server, alone: a server that busy-polls when idle shows it here.
    for name in names:
        before = group_cpu_seconds(servers[name].procs[0].pid)
        await asyncio.sleep(args.idle_seconds)
        used = group_cpu_seconds(servers[name].procs[0].pid) - before
        print(f"idle {name}: {100 * used / args.idle_seconds:.1f}% of a core over {args.idle_seconds:.0f} s")

    warm = prompts_for(tokenizer, max(args.concurrency), rng)
    for name in names:  # warm-up: first requests, compiled shapes, allocator
        await run_load(clients[name], warm, 2, args.new_tokens, user, f"warm-{name}")

    idle_other: dict[str, list[float]] = {name: [] for name in names}
    session = aiohttp.ClientSession()
    address = {name: servers[name].addresses[0] for name in names}
    for concurrency in args.concurrency:
        for turns in args.turns:
            rates: dict[str, list[float]] = {name: [] for name in names}
            step_ms: dict[str, list[float]] = {name: [] for name in names}
            step_tokens: dict[str, list[float]] = {name: [] for name in names}
            busy: dict[str, list[float]] = {name: [] for name in names}
            hit: dict[str, list[float]] = {name: [] for name in names}
            for rnd in range(args.rounds):
                prompts = prompts_for(tokenizer, concurrency, rng)
                order = names if rnd % 2 == 0 else names[::-1]
                for name in order:
                    await asyncio.sleep(args.settle)  # vLLM's worker spins on its queue ~1 s after its last step
                    other = next(n for n in names if n != name)
                    before = await server_counters(session, name, address[name])
                    other_before = group_cpu_seconds(servers[other].procs[0].pid)
                    tokens, seconds = await run_load(
                        clients[name], prompts, turns, args.new_tokens, user, f"c{concurrency}t{turns}r{rnd}"
                    )
                    other_used = group_cpu_seconds(servers[other].procs[0].pid) - other_before
                    after = await server_counters(session, name, address[name])
                    delta = {k: after[k] - before[k] for k in after}
                    step_ms[name].append(1000 * seconds / max(delta["steps"], 1))
                    step_tokens[name].append(delta["tokens"] / max(delta["steps"], 1))
                    busy[name].append(delta["busy"] / seconds)
                    hit[name].append(delta["hits"] / max(delta["looked_up"], 1))
                    idle_other[other].append(other_used / seconds)
                    rates[name].append(tokens / seconds)
            ours, theirs = (statistics.median(rates[n]) for n in names)
            detail = " | ".join(f"{n}: " + ", ".join(f"{r:.0f}" for r in rates[n]) for n in names)
            print(
                f"{concurrency} concurrent, {turns} turn{'s' if turns > 1 else ''}: {names[0]} {ours:.0f} tok/s, "
                f"{names[1]} {theirs:.0f} tok/s, ratio {ours / theirs:.2f}x   ({detail})",
                flush=True,
            )
            print(
                "    "
                + "; ".join(
                    f"{n}: {statistics.median(step_ms[n]):.1f} ms of wall a model step of "
                    f"{statistics.median(step_tokens[n]):.0f} tokens, prefix cache "
                    f"{100 * statistics.median(hit[n]):.0f}% of prompt tokens"
                    + (
                        ""
                        if math.isnan(statistics.median(busy[n]))
                        else f", engine busy {100 * statistics.median(busy[n]):.0f}% of wall"
                    )
                    for n in names
                ),
                flush=True,
            )
    await session.close()
    for name in names:
        print(
            f"{name} while the other was measured: median {100 * statistics.median(idle_other[name]):.1f}% "
            f"of a core (max {100 * max(idle_other[name]):.1f}%)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 64 concurrent only, 16 new tokens")
    parser.add_argument("--rounds", type=int, default=None, help="alternated rounds per load (3)")
    parser.add_argument("--new-tokens", type=int, default=None, help="sampled tokens per request and turn (32)")
    parser.add_argument("--concurrency", default=None, help="concurrent episodes, comma-separated (64,256)")
    parser.add_argument("--turns", default="1,4", help="turns per episode, comma-separated")
    parser.add_argument(
        "--vllm-args", default="", help='more vLLM flags, e.g. "--max-num-seqs 256 --block-size 32" (one string)'
    )
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds of quiet before each measurement")
    parser.add_argument("--hidden", type=int, default=128, help="model width (heads of 32: hidden / 32 heads)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (starts faster)")
    parser.add_argument("--log-dir", default=None, help="the servers' logs (default: a temporary directory)")
    parser.add_argument("--against", choices=("vllm", "glibc-malloc", "eager"), default="vllm", help="the other server")
    parser.add_argument("--compile-decode", action="store_true", help="serve-model with --compile-decode")
    parser.add_argument("--vllm-preload", default=None, help="LD_PRELOAD of vLLM's processes (default: tcmalloc)")
    args = parser.parse_args()
    quick = {"rounds": 1, "concurrency": "64", "new_tokens": 16}
    full = {"rounds": 3, "concurrency": "64,256", "new_tokens": 32}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.concurrency = tuple(int(c) for c in args.concurrency.split(","))
    args.turns = tuple(int(t) for t in args.turns.split(","))
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    heads = args.hidden // 32  # vLLM's CPU attention takes head sizes 32, 64, 80, 96, 112, 128, 192, 256
    path = str(
        save_tiny_model(
            tempfile.mkdtemp(prefix="bench-vllm-"),
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=heads,
            intermediate_size=2 * args.hidden,
        )
    )
    tokenizer = load_tokenizer(path)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-vllm-logs-"))
    ours = EngineConfig(backend="serve-model", cpu_threads=1, compile_decode=args.compile_decode)
    preload = TCMALLOC if args.vllm_preload is None else args.vllm_preload
    if args.against == "vllm":
        other = EngineConfig(
            backend="vllm",
            vllm_python=args.vllm_python,
            extra_args=(["--enforce-eager"] if args.enforce_eager else []) + args.vllm_args.split(),
        )
        mode = "eager" if args.enforce_eager else "compiled"
        cfgs = {"serve-model": ours, "vLLM": other}
        against = f"vLLM {mode} {args.vllm_args}, LD_PRELOAD={preload or '(none)'}"
    elif args.against == "glibc-malloc":
        cfgs, against = {"serve-model": ours, "serve-model-glibc-malloc": ours}, f"{MALLOC_ENV}=system"
    else:
        eager = dataclasses.replace(ours, compile_decode=False)
        cfgs, against = {"serve-model": ours, "serve-model-eager": eager}, "serve-model without --compile-decode"
    print(
        f"== bench/engine_vs_vllm == Llama (hidden {args.hidden}, {args.layers} layers, {heads} heads of 32), float32, "
        f"{args.new_tokens} new "
        f"tokens a request (turn), {USER_TOKENS} user tokens between turns, {args.rounds} alternated round(s); "
        f"serve-model{' --compile-decode' if args.compile_decode else ''} against {against}; {os.cpu_count()} CPUs",
        flush=True,
    )
    servers: dict[str, ServerGroup] = {}
    try:
        for name, cfg in cfgs.items():
            start = time.perf_counter()
            policy = "system" if name.endswith("glibc-malloc") else os.environ.get(MALLOC_ENV, "keep")
            loads = preload if name == "vLLM" else os.environ.get("LD_PRELOAD", "")
            with _environ(MALLOC_ENV, policy), _environ("LD_PRELOAD", loads):  # a server gets this process's
                servers[name] = launch_servers(cfg, path, log_dir=log_dir / name, supervise=False)
            print(f"{name} started in {time.perf_counter() - start:.0f} s", flush=True)
        clients = {name: engine_client(cfgs[name], servers[name].addresses) for name in cfgs}

        async def run() -> None:
            try:
                await measure(args, tokenizer, servers, clients)
            finally:
                for client in clients.values():
                    await client.aclose()

        asyncio.run(run())
    finally:
        for group in servers.values():
            group.stop()
    sys.stdout.flush()


@contextlib.contextmanager
def _environ(key: str, value: str) -> Iterator[None]:
    """``key=value`` in this process's environment for the block (the previous value after it)."""
    before = os.environ.get(key)
    os.environ[key] = value  # (an empty LD_PRELOAD preloads nothing)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key)
        else:
            os.environ[key] = before


if __name__ == "__main__":
    main()
