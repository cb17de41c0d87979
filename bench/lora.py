"""LoRA vs full-parameter RL on the arithmetic recipe, from one SFT start, with the figures issue 32 asks for.

    .venv/bin/python bench/lora.py [--rl-steps N] [--r 16] [--lora-lr 1e-3] [--out runs/bench_lora]

Runs the recipe's SFT once, then its RL twice from that model in the same number of steps: full weights at
the recipe's learning rate, and a LoRA adapter (rank ``--r``, alpha 2r, every linear layer) at its own rate.
Prints each run's held-out gain over the SFT model, the optimizer state each keeps (bytes, measured after
one real update) and the bytes each weight push moves (``perf/weight_sync_bytes``), LoRA over full.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import replace
from pathlib import Path

import torch
import transformers
from e2e_arith import RECIPE, prepare_sft  # bench/ is on sys.path when this script runs
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from areal_agents.config import LoraConfig, TrainConfig, load_config
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.trainers.rl_recipe import run_train
from areal_agents.trainers.sft_recipe import run_sft
from areal_agents.types import Trajectory


def rl_run(out: Path, sft_model: str, seed: int, steps: int | None, extra: list[str]) -> tuple[dict, float, float]:
    """One RL run of the recipe: its summary, wall seconds and the mean bytes of a weight push."""
    overrides = [f"run_dir={out}", f"model.path={sft_model}", f"seed={seed}", *extra]
    overrides += [f"steps={steps}"] if steps else []
    start = time.perf_counter()
    summary = run_train(load_config(TrainConfig, RECIPE / "rl.yaml", overrides), progress=False)
    wall = time.perf_counter() - start
    pushes = EventAccumulator(str(out / "tensorboard")).Reload().Scalars("perf/weight_sync_bytes")
    return summary, wall, sum(e.value for e in pushes) / len(pushes)


def optimizer_state_bytes(model_path: str, lora: LoraConfig | None) -> int:
    """Bytes of AdamW's state after one real update of a policy (full weights, or ``lora``)."""
    spec = TrainSpec.of(load_config(TrainConfig, RECIPE / "rl.yaml", [f"model.path={model_path}"]), pad_token_id=0)
    policy = load_trainable("policy", replace(spec, lora=lora), model_path, model_path)
    trajectories = [
        Trajectory([5, 6, 7, 8, 9], [0, 0, 1, 1, 1], [0, 0, -2.0, -2.0, -2.0], [-1, -1, 0, 0, 0], float(r), "g")
        for r in (0, 1)
    ]
    asyncio.run(policy.update(trajectories, torch.Generator().manual_seed(0)))
    state = policy.optimizer.state_dict()["state"].values()
    policy.close()
    return sum(t.numel() * t.element_size() for s in state for t in s.values() if torch.is_tensor(t) and t.dim())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_lora")
    parser.add_argument("--rl-steps", type=int, default=None, help="override the recipe's RL steps (300)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--r", type=int, default=16, help="the adapter's rank (alpha = 2r)")
    parser.add_argument("--lora-lr", type=float, default=1e-3, help="the adapter's learning rate")
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    out = Path(args.out)

    sft = run_sft(prepare_sft(out, args.seed), progress=False)
    full, full_wall, full_push = rl_run(out / "full", sft["model"], args.seed, args.rl_steps, [])
    lora_args = [f"model.lora.r={args.r}", f"model.lora.alpha={2 * args.r}", f"ppo.lr={args.lora_lr}"]
    lora, lora_wall, lora_push = rl_run(out / "lora", sft["model"], args.seed, args.rl_steps, lora_args)
    lora_cfg = LoraConfig(r=args.r, alpha=2 * args.r)
    full_state, lora_state = optimizer_state_bytes(sft["model"], None), optimizer_state_bytes(sft["model"], lora_cfg)

    base = sft["accuracy_after"]
    print(f"\n== bench/lora (arithmetic recipe, {full['steps']} RL steps, seed {args.seed}) ==")
    print(f"SFT accuracy:             {base:.1%}  ({sft['eval_problems']} held-out problems, greedy)")
    for name, s, wall in (("full", full, full_wall), (f"LoRA r={args.r}", lora, lora_wall)):
        gain = 100 * (s["accuracy_after"] - base)
        print(f"RL {name:<12} accuracy: {s['accuracy_after']:.1%}  gain {gain:+.1f} points  ({wall:.0f} s)")
    print(f"LoRA gain - full gain:    {100 * (lora['accuracy_after'] - full['accuracy_after']):+.1f} points")
    print(f"LoRA learning rate:       {args.lora_lr:g}  (full: the recipe's)")
    print(f"optimizer state bytes:    full {full_state:,}  LoRA {lora_state:,}  ratio {lora_state / full_state:.3f}")
    print(f"weight-sync bytes a push: full {full_push:,.0f}  LoRA {lora_push:,.0f}  ratio {lora_push / full_push:.3f}")


if __name__ == "__main__":
    main()
