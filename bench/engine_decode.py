"""`HFEngine` under the count recipe's load: its KV cache in segments, in bfloat16, and its own decode step.

    .venv/bin/python bench/engine_decode.py [--model runs/count/sft/model] [--groups 120 --repeats 2]

The load of `bench/async_vs_sync.py --task count` at max_staleness 4: groups of 16 requests sharing a
prompt, ``--in-flight`` groups running (a finished group is replaced at once), answers of long-tailed
length (`sample_count`'s log-normal number of counted numbers, median 6, up to 32), one engine thread
as the processes layout runs it. The same engine, model and requests with ``max_segments`` 1 (one
float32 cache as wide as the oldest row: the engine before segments, the baseline), 8 (the default),
8 with ``kv_dtype="bfloat16"``, these three through transformers' forward (``fast_decode=False``), and
the last with the engine's own Llama decode step (`LlamaDecodeStep`, the default), alternated
``--repeats`` times; prints ms per decode step, samples/s, the share of attended KV cells that were
padding, and the ratios to the baseline. Lengths are forced (``ignore_eos``) so all do the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import numpy as np
import torch
import transformers

from areal_agents.engines import HFEngine
from areal_agents.engines.hf.engine import MAX_SEGMENTS
from areal_agents.envs.count import Count, sample_count
from areal_agents.models import load_model, load_tokenizer, save_tiny_model
from areal_agents.types import GenRequest, SamplingParams


def count_load(tokenizer, groups: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the group's answer lengths in tokens) for ``groups`` Count-v0 problems: each answer's
    length is that of a count drawn as the env draws them (`sample_count`), with its EOS, capped at 136."""
    rng = np.random.default_rng(seed)

    def draw() -> Count:
        return sample_count(rng, start_below=100, median_length=6, sigma=0.8, max_length=32)

    def answer_tokens() -> int:
        return min(136, len(tokenizer.encode(draw().answer, add_special_tokens=False)) + 1)

    out = []
    for _ in range(groups):
        messages = [{"role": "user", "content": draw().text}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        out.append((prompt, [answer_tokens() for _ in range(16)]))
    return out


def run_load(engine: HFEngine, load: list[tuple[list[int], list[int]]], in_flight: int) -> tuple[float, float, float]:
    """Samples/s, ms per decode step and the padding share of attended KV cells, ``in_flight`` groups at once."""

    async def group(g: int, prompt: list[int], lengths: list[int]) -> None:
        await asyncio.gather(
            *(
                engine.agenerate(GenRequest(f"{g}-{i}", prompt, SamplingParams(n, temperature=1.0, ignore_eos=True)))
                for i, n in enumerate(lengths)
            )
        )

    async def run() -> None:
        gate = asyncio.Semaphore(in_flight)

        async def gated(g: int, prompt: list[int], lengths: list[int]) -> None:
            async with gate:
                await group(g, prompt, lengths)

        await asyncio.gather(*(gated(g, p, n) for g, (p, n) in enumerate(load)))

    st = engine.stats
    steps, busy, cells, context = st.decode_steps, st.busy_seconds, st.kv_cells, st.kv_context_cells
    start = time.perf_counter()
    asyncio.run(run())
    wall = time.perf_counter() - start
    ms = 1000 * (st.busy_seconds - busy) / max(1, st.decode_steps - steps)
    return 16 * len(load) / wall, ms, 1 - (st.kv_context_cells - context) / max(1, st.kv_cells - cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint (default: a fresh tiny model)")
    parser.add_argument("--groups", type=int, default=120, help="groups of 16 requests per measurement")
    parser.add_argument("--in-flight", type=int, default=24, help="groups running at once")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    settings = {
        "1 segment": (1, "auto", False),
        f"{MAX_SEGMENTS} segments": (MAX_SEGMENTS, "auto", False),
        f"{MAX_SEGMENTS} segments, bfloat16 KV": (MAX_SEGMENTS, "bfloat16", False),
        "... + own decode step": (MAX_SEGMENTS, "bfloat16", True),
    }
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or save_tiny_model(tmp)
        tokenizer = load_tokenizer(path)
        load = count_load(tokenizer, args.groups, seed=0)
        for _ in range(args.repeats):
            for name, (segments, kv_dtype, fast_decode) in settings.items():
                engine = HFEngine(
                    load_model(path),
                    max_batch_size=256,
                    num_threads=args.threads,
                    prefix_cache_tokens=0,
                    stale_kv="keep",
                    seed=0,
                    max_segments=segments,
                    kv_dtype=kv_dtype,
                    fast_decode=fast_decode,
                )
                run_load(engine, load[: args.in_flight], args.in_flight)  # warm-up
                results[name].append(run_load(engine, load, args.in_flight))
                engine.close()
    print(f"== bench/engine_decode ({args.groups} groups of 16, {args.in_flight} in flight, {args.threads} thread) ==")
    med = {name: [statistics.median(r[i] for r in runs) for i in range(3)] for name, runs in results.items()}
    for name, runs in results.items():
        each = ", ".join(f"{r[1]:.2f}" for r in runs)
        rate, ms, padding = med[name]
        base = med["1 segment"]
        print(
            f"{name:>24}: {ms:6.2f} ms a decode step ({each}) = {base[1] / ms:.2f}x faster, {rate:6.1f} samples/s "
            f"= {rate / base[0]:.2f}x, {padding:.0%} of the KV cells attended were padding"
        )


if __name__ == "__main__":
    main()
