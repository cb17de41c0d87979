"""What the run's timeline costs: the arithmetic recipe's RL with ``timeline.enabled`` on and off, alternated.

    .venv/bin/python bench/timeline_overhead.py [--pairs 3] [--rl-steps 30] [--sft-model PATH] [--out DIR]

Without ``--sft-model`` it trains the recipe's SFT start first (bench/e2e_arith.py's). Each pair runs off, then
on (the next pair on, then off: neither side always runs on a warmer machine). Prints each run's trained
samples/s (over the trainer's busy time) and samples/s end to end (over the training steps), and the ratio of
the means, on/off: 1.00 is no cost; the issue's budget is 0.98.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import transformers
from e2e_arith import RECIPE, prepare_sft  # bench/ is on sys.path when this script runs

from areal_agents.config import TrainConfig, load_config
from areal_agents.trainers.rl_recipe import run_train
from areal_agents.trainers.sft_recipe import run_sft


def one_run(out: Path, model: str, steps: int, seed: int, enabled: bool, k: int) -> dict:
    side = "on" if enabled else "off"
    overrides = [
        f"run_dir={out / f'rl_{k}_{side}'}", f"model.path={model}", f"seed={seed}", f"steps={steps}",
        f"timeline.enabled={str(enabled).lower()}",
    ]  # fmt: skip
    return run_train(load_config(TrainConfig, RECIPE / "rl.yaml", overrides), progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_timeline")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rl-steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sft-model", default="", help="an SFT model to start RL from (default: train one)")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    out = Path(args.out)
    model = args.sft_model or run_sft(prepare_sft(out, args.seed), progress=False)["model"]
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for k in range(args.pairs):
        for enabled in (False, True) if k % 2 == 0 else (True, False):
            summary = one_run(out, model, args.rl_steps, args.seed, enabled, k)
            runs[enabled].append(summary)
            print(
                f"pair {k} timeline {'on ' if enabled else 'off'}: trained samples/s "
                f"{summary['trained_samples_per_s']:.0f}, samples/s end to end {summary['samples_per_s']:.0f}",
                flush=True,
            )
    print("\n== bench/timeline_overhead ==")
    for key, label in (("trained_samples_per_s", "trained samples/s"), ("samples_per_s", "samples/s end to end")):
        on = statistics.mean(s[key] for s in runs[True])
        off = statistics.mean(s[key] for s in runs[False])
        print(f"{label:22s} on {on:7.0f} | off {off:7.0f} | on/off {on / off:.3f}")


if __name__ == "__main__":
    main()
