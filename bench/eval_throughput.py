"""Evaluation throughput: problems/s and samples/s of `areal-agents eval`, concurrent vs one episode at a time.

    .venv/bin/python bench/eval_throughput.py [--model runs/arith/sft/model] [--problems 50] [--n-samples 4]

Runs the tiny model (built here if no --model) on the first problems of bundled MATH-500 (or --dataset),
twice in the same run: with 64 episodes in flight and with 1 (the baseline), and prints the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import transformers

from areal_agents.engines.hf.engine import HFEngine
from areal_agents.eval.runner import EvalSettings, evaluate_dataset
from areal_agents.models import load_model, load_tokenizer, save_tiny_model


async def timed(settings: EvalSettings, model_dir: str, out: Path) -> tuple[float, dict]:
    engine = HFEngine(load_model(model_dir), seed=0)
    try:
        start = time.perf_counter()
        summary = await evaluate_dataset(settings, engine, load_tokenizer(model_dir), out, progress=False)
        return time.perf_counter() - start, summary
    finally:
        await engine.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a model directory; default: a fresh tiny model")
    parser.add_argument("--dataset", default="math500", help="a bundled set, a JSONL path or hf:ORG/NAME")
    parser.add_argument("--problems", type=int, default=50)
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(save_tiny_model(Path(tmp) / "tiny"))
        print(
            f"== bench/eval_throughput: {args.problems} problems x {args.n_samples} samples, "
            f"{args.max_new_tokens} new tokens, model {model} =="
        )
        rates = {}
        for concurrency in (1, 64):
            settings = EvalSettings(
                env_id="areal_agents/Math-v0",
                env_kwargs={"dataset": args.dataset},
                n_samples=args.n_samples,
                temperature=0.6,
                top_p=0.95,
                max_new_tokens=args.max_new_tokens,
                concurrency=concurrency,
                num_problems=args.problems,
            )
            seconds, summary = asyncio.run(timed(settings, model, Path(tmp) / f"out{concurrency}"))
            rates[concurrency] = summary["samples"] / seconds
            print(
                f"concurrency {concurrency:3d}: {summary['problems'] / seconds:6.2f} problems/s | "
                f"{rates[concurrency]:7.2f} samples/s | {rates[concurrency] / rates[1]:5.2f}x one at a time"
            )


if __name__ == "__main__":
    main()
