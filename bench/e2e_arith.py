"""End-to-end arithmetic recipe benchmark: tiny model -> SFT -> RL, with the figures issue 2 asks for.

    .venv/bin/python bench/e2e_arith.py [--rl-steps N] [--out runs/bench_arith] [--engine serve-model|vllm]

``--engine vllm`` runs the RL part on a vLLM server started from ``--vllm-python`` (an environment of its
own: ``bash scripts/setup.sh --with-vllm`` builds ``.venv-vllm``).

Prints SFT accuracy, RL accuracy (held-out, greedy, same problems), wall seconds, trained samples/s
and generated tokens/s. The baseline for the RL figure is the SFT model, measured in the same run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import transformers

from areal_agents.config import SFTConfig, TrainConfig, load_config
from areal_agents.models import save_tiny_model
from areal_agents.trainers.rl_recipe import run_train
from areal_agents.trainers.sft_recipe import run_sft

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "arithmetic"


def prepare_sft(out: Path, seed: int, steps: int | None = None) -> SFTConfig:
    """The recipe's SFT start, ready to run: a tiny model, 20,000 demonstrations and the sft.yaml config."""
    save_tiny_model(out / "tiny", overwrite=True)
    data = out / "sft_data.jsonl"
    subprocess.run(
        [sys.executable, str(RECIPE / "make_sft_data.py"), str(data), "--n", "20000"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    overrides = [f"run_dir={out / 'sft'}", f"data={data}", f"model.path={out / 'tiny'}", f"seed={seed}"]
    return load_config(SFTConfig, RECIPE / "sft.yaml", overrides + ([f"steps={steps}"] if steps else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_arith")
    parser.add_argument("--rl-steps", type=int, default=None, help="override the recipe's RL steps")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--engine",
        choices=["hf", "serve-model", "vllm"],
        default="hf",
        help="in-process, or HTTP model servers (remote path): ours (serve-model) or vLLM's",
    )
    parser.add_argument(
        "--vllm-python",
        default=str(ROOT / ".venv-vllm" / "bin" / "python"),
        help="--engine vllm: the Python of an environment with vLLM",
    )
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    out = Path(args.out)

    start = time.perf_counter()
    sft_cfg = prepare_sft(out, args.seed)
    t_sft = time.perf_counter()
    sft = run_sft(sft_cfg, progress=False)
    t_rl = time.perf_counter()
    rl_overrides = [f"run_dir={out / 'rl'}", f"model.path={sft['model']}", f"seed={args.seed}"]
    rl_overrides.append(f"engine.backend={args.engine}")
    if args.engine == "vllm":
        rl_overrides.append(f"engine.vllm_python={args.vllm_python}")
    if args.rl_steps:
        rl_overrides.append(f"steps={args.rl_steps}")
    rl = run_train(load_config(TrainConfig, RECIPE / "rl.yaml", rl_overrides), progress=False)
    end = time.perf_counter()

    print(f"\n== bench/e2e_arith (engine: {args.engine}) ==")
    print(f"SFT accuracy:          {sft['accuracy_after']:.1%}  ({sft['eval_problems']} held-out problems, greedy)")
    print(f"RL accuracy:           {rl['accuracy_after']:.1%}  ({rl['steps']} RL steps)")
    print(f"RL gain:               {100 * (rl['accuracy_after'] - sft['accuracy_after']):+.1f} points")
    print(f"wall seconds:          {end - start:.0f}  (SFT {t_rl - t_sft:.0f}, RL {end - t_rl:.0f})")
    print(f"trained samples/s:     {rl['trained_samples_per_s']:.0f}  (over the trainer's busy time)")
    print(f"samples/s end to end:  {rl['samples_per_s']:.0f}  (over the training steps: rollout waits included)")
    print(f"generated tokens/s:    {rl['generated_tokens_per_s']:.0f}")


if __name__ == "__main__":
    main()
