"""Generated tokens/s of `HFEngine` (continuous batching) against `model.generate`, measured in the same run.

    .venv/bin/python bench/engine.py [--hidden 256 --layers 4 --new-tokens 64]

At 1, 16 and 64 concurrent requests (prompts of varied length, every request generating exactly
``--new-tokens`` sampled tokens): HFEngine with that many concurrent ``agenerate`` calls, plain
``model.generate`` called once per request, and ``model.generate`` on one left-padded batch of all of
them. Same model, prompts and lengths. Target (issue 6): >= 5x the per-request baseline at 64.
Then the pause-to-resume latency of a weight update with 64 requests in flight, and multi-turn
episodes (64 at once, 4 turns, each turn's request = the conversation so far + a 16-token reply)
with the prefix cache against the same engine without it (every turn prefilled from scratch).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

import torch
import transformers

from areal_agents.engines import HFEngine
from areal_agents.models import load_model, load_tokenizer, save_tiny_model
from areal_agents.types import GenRequest, SamplingParams


def prompts_for(tokenizer, n: int, rng: random.Random) -> list[list[int]]:
    out = []
    for _ in range(n):
        a, b = rng.randrange(10 ** rng.randint(1, 6)), rng.randrange(10 ** rng.randint(1, 6))
        out.append(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{a}+{b}="}], add_generation_prompt=True, return_dict=False
            )
        )
    return out


def engine_rate(engine: HFEngine, prompts: list[list[int]], new_tokens: int) -> float:
    sampling = SamplingParams(new_tokens, temperature=1.0, ignore_eos=True)

    async def run() -> int:
        responses = await asyncio.gather(
            *(engine.agenerate(GenRequest(f"r{i}", p, sampling)) for i, p in enumerate(prompts))
        )
        return sum(len(r.output_tokens) for r in responses)

    start = time.perf_counter()
    tokens = asyncio.run(run())
    return tokens / (time.perf_counter() - start)


@torch.inference_mode()
def per_request_rate(model, prompts: list[list[int]], new_tokens: int, pad: int) -> float:
    start, tokens = time.perf_counter(), 0
    for p in prompts:
        out = model.generate(
            torch.tensor([p]), do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad
        )
        tokens += out.shape[1] - len(p)
    return tokens / (time.perf_counter() - start)


@torch.inference_mode()
def padded_batch_rate(model, prompts: list[list[int]], new_tokens: int, pad: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=True,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad,
    )
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - start)


def update_latency(engine: HFEngine, model, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """Seconds of update_weights (pause at a step boundary, load, resume) with the requests in flight."""
    sampling = SamplingParams(new_tokens * 4, temperature=1.0, ignore_eos=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    async def run() -> tuple[float, int]:
        tasks = [
            asyncio.ensure_future(engine.agenerate(GenRequest(f"u{i}", p, sampling))) for i, p in enumerate(prompts)
        ]
        while engine.num_running < len(prompts):
            await asyncio.sleep(0.001)
        start = time.perf_counter()
        await engine.update_weights(state)
        latency = time.perf_counter() - start
        responses = await asyncio.gather(*tasks)
        return latency, sum(1 in r.output_versions and 0 in r.output_versions for r in responses)

    return asyncio.run(run())


def multi_turn_rate(engine: HFEngine, prompts: list[list[int]], reply: list[int], turns: int) -> float:
    """Episodes/s of ``turns``-turn conversations, all ``prompts`` at once, 8 sampled tokens a turn."""
    sampling = SamplingParams(8, temperature=1.0, ignore_eos=True)

    async def episode(i: int, context: list[int]) -> None:
        for turn in range(turns):
            r = await engine.agenerate(GenRequest(f"m{i}.{turn}", context, sampling))
            context = context + r.output_tokens + reply

    async def run() -> None:
        await asyncio.gather(*(episode(i, p) for i, p in enumerate(prompts)))

    start = time.perf_counter()
    asyncio.run(run())
    return len(prompts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    path = save_tiny_model(
        tempfile.mkdtemp(prefix="bench-engine-"),
        hidden_size=args.hidden,
        num_layers=args.layers,
        intermediate_size=args.hidden * 2,
    )
    tokenizer, model = load_tokenizer(path), load_model(path).eval()
    pad = tokenizer.pad_token_id
    params = sum(p.numel() for p in model.parameters())
    print(f"== bench/engine == model: Llama {params / 1e6:.1f}M params, {args.new_tokens} new tokens per request")
    rng = random.Random(args.seed)
    engine = HFEngine(load_model(path), seed=args.seed)
    for concurrency in (1, 16, 64):
        prompts = prompts_for(tokenizer, concurrency, rng)
        ours = engine_rate(engine, prompts, args.new_tokens)
        single = per_request_rate(model, prompts, args.new_tokens, pad)
        batch = padded_batch_rate(model, prompts, args.new_tokens, pad)
        print(
            f"{concurrency:2d} concurrent: HFEngine {ours:8.0f} tok/s | generate per request {single:7.0f} tok/s "
            f"= {ours / single:5.1f}x | generate padded batch {batch:7.0f} tok/s = {ours / batch:4.2f}x"
        )
    latency, switched = update_latency(engine, model, prompts_for(tokenizer, 64, rng), args.new_tokens)
    print(
        f"weight update with 64 requests in flight: pause-to-resume {latency * 1000:.0f} ms; "
        f"{switched}/64 sequences switched version mid-way"
    )
    engine.close()
    prompts = prompts_for(tokenizer, 64, rng)
    reply = tokenizer.apply_chat_template([{"role": "user", "content": "x" * 8}], return_dict=False)[:16]
    rates = {}
    for tokens in (0, 65536):
        engine = HFEngine(load_model(path), seed=args.seed, prefix_cache_tokens=tokens)
        rates[tokens] = multi_turn_rate(engine, prompts, reply, turns=4)
        hit, run = engine.stats.prefix_hit_tokens, engine.stats.prefill_tokens
        engine.close()
    print(
        f"multi-turn (64 episodes x 4 turns): prefix cache {rates[65536]:.1f} episodes/s | without "
        f"{rates[0]:.1f} = {rates[65536] / rates[0]:.2f}x ({hit} of {hit + run} context tokens from the cache)"
    )


if __name__ == "__main__":
    main()
