"""Debate stability over seeds: held-out accuracy and per-agent reward curves of the debate recipe.

    .venv/bin/python bench/debate_seeds.py --sft-model runs/debate/sft/model [--seeds 1 2 3] [--steps 60]
        [--eval-every 10] [--problems 200] [--recipe examples/debate/rl.yaml] [--report-only]

Trains the recipe once per seed (``areal-agents train RECIPE seed=K run_dir=OUT/seedK``, held-out greedy
accuracy every ``--eval-every`` steps, each step's trajectories dumped), one run after another; then reads
each run's TensorBoard logs and trajectory dumps and prints, per seed: the held-out accuracy at each
evaluation, each debater's batch reward (the mean of the first and of the last 10 steps), and what a
collapse would show: the lowest accuracy after the peak, the per-token entropy of the sampled answers
(mean -log π_behav at temperature 1: an estimate of the policy's entropy), the fraction of empty answers,
how often a debater's final answer changed to the other's, how often the two agree at the end, PPO's
clip fraction and the fraction of zero-variance groups. ``--report-only`` prints the table of the runs
already there. The first lines printed are the commands that reproduce each run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def train_command(args: argparse.Namespace, seed: int) -> list[str]:
    """The CLI command of one seed's run (relative paths, as a reader re-runs it from the repo root)."""
    sft_model, recipe = args.sft_model, args.recipe
    overrides = [f"seed={seed}", f"run_dir={args.out}/seed{seed}", f"steps={args.steps}"]
    overrides += [f"eval.every={args.eval_every}", f"eval.num_problems={args.problems}"]
    overrides += [f"model.path={sft_model}", "rollout.dump_trajectories=true"]
    if "policies" in (ROOT / recipe).read_text():  # the separate-policy recipe: each debater starts from the model
        overrides += [f"policies.debater_0={sft_model}", f"policies.debater_1={sft_model}"]
    return ["areal-agents", "train", recipe, "--overwrite", *overrides]


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from ``run_dir/tensorboard``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    return {tag: {e.step: float(e.value) for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def answer_stats(run_dir: Path) -> dict[int, dict[str, float]]:
    """Per step, from the dumped trajectories: entropy estimate, empty answers, switches to the other's answer."""
    out = {}
    for path in sorted((run_dir / "trajectories").glob("step_*.jsonl")):
        step = int(path.stem.split("_")[1])
        nll, empty, answers, switched, changed, agree, debates = [], 0, 0, 0, 0, 0, 0
        rounds: dict[str, dict[str, list[str]]] = {}  # episode -> agent -> its answers by round
        for line in path.open():
            t = json.loads(line)
            nll += [-lp for lp, m in zip(t["logprobs"], t["loss_mask"]) if m]
            mine = [m["content"].strip() for m in t["metadata"]["messages"] if m["role"] == "assistant"]
            rounds.setdefault(t["metadata"]["episode"], {})[t["agent_id"]] = mine
            empty += sum(not a for a in mine)
            answers += len(mine)
        for agents in rounds.values():
            if len(agents) != 2 or min(len(a) for a in agents.values()) < 2:
                continue
            (a0, b0), (a1, b1) = ((x[0], x[-1]) for x in agents.values())
            agree, debates = agree + (b0 == b1), debates + 1
            for first, last, other in ((a0, b0, a1), (a1, b1, a0)):
                changed += first != other  # the debaters disagreed in round 1
                switched += first != other and last == other  # ... and this one took the other's answer
        out[step] = {
            "entropy": float(np.mean(nll)) if nll else float("nan"),
            "empty": empty / max(answers, 1),
            "switched": switched / max(changed, 1),
            "agree": agree / max(debates, 1),
        }
    return out


def mean_over(series: dict[int, float], steps: list[int]) -> float:
    values = [series[s] for s in steps if s in series]
    return float(np.mean(values)) if values else float("nan")


def report(run_dir: Path, seed: int) -> tuple[str, list[tuple[int, float]]]:
    """One seed's line of the table, and its held-out accuracy curve."""
    tags = scalars(run_dir)
    evals = sorted(tags.get("eval/accuracy", {}).items())
    steps = sorted(tags.get("rollout/reward_mean", {}))
    first, last = steps[:10], steps[-10:]
    agents = sorted(t.split("/", 2)[2] for t in tags if t.startswith("rollout/reward_agent/"))
    rewards = " | ".join(
        f"{a} {mean_over(tags[f'rollout/reward_agent/{a}'], first):.2f} -> "
        f"{mean_over(tags[f'rollout/reward_agent/{a}'], last):.2f}"
        for a in agents
    )
    peak = max(range(len(evals)), key=lambda i: evals[i][1]) if evals else 0
    low_after = min((v for _, v in evals[peak:]), default=float("nan"))
    answers = answer_stats(run_dir)
    shape = {k: (mean_over({s: v[k] for s, v in answers.items()}, first), mean_over(
        {s: v[k] for s, v in answers.items()}, last)) for k in ("entropy", "empty", "switched", "agree")}  # fmt: skip
    clip = [k for k in tags if k.startswith("train/") and k.endswith("clip_fraction") and "dual" not in k]
    flat = [k for k in tags if k.endswith("zero_variance_group_fraction")]
    line = (
        f"seed {seed}: held-out accuracy "
        + " ".join(f"{s}:{v:.1%}" for s, v in evals)
        + f" | lowest after the peak {low_after:.1%} | final, each debater's own: "
        + ", ".join(f"{a} {tags[f'eval/accuracy/{a}'][evals[-1][0]]:.1%}" for a in agents if evals)
        + "\n"
        f"        reward (first 10 -> last 10 steps) {rewards}\n"
        f"        entropy/token {shape['entropy'][0]:.3f} -> {shape['entropy'][1]:.3f} | empty answers "
        f"{shape['empty'][0]:.1%} -> {shape['empty'][1]:.1%} | took the other's answer "
        f"{shape['switched'][0]:.1%} -> {shape['switched'][1]:.1%} | final answers agree "
        f"{shape['agree'][0]:.1%} -> {shape['agree'][1]:.1%}\n        clip fraction (last 10) "
        + ", ".join(f"{mean_over(tags[k], last):.3f}" for k in clip)
        + " | zero-variance groups (last 10) "
        + ", ".join(f"{mean_over(tags[k], last):.0%}" for k in flat)
    )
    return line, evals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-model", default="runs/debate/sft/model", help="examples/debate/run.sh's SFT model")
    parser.add_argument("--recipe", default="examples/debate/rl.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--problems", type=int, default=200, help="held-out problems (the recipe's 200)")
    parser.add_argument("--out", default="runs/debate_seeds")
    parser.add_argument("--report-only", action="store_true", help="print the table of the runs already in --out")
    args = parser.parse_args()
    out = Path(args.out)
    commands = {k: train_command(args, k) for k in args.seeds}
    for command in commands.values():
        print("$ " + " ".join(command))
    if not args.report_only:
        for command in commands.values():
            cli = [sys.executable, "-m", "areal_agents.cli", *command[1:]]
            subprocess.run(cli, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    print(f"\n== bench/debate_seeds: {args.recipe}, {args.steps} steps, held-out accuracy every {args.eval_every} ==")
    curves = {}
    for seed in args.seeds:
        line, curves[seed] = report(ROOT / out / f"seed{seed}", seed)
        print(line)
    steps = sorted({s for c in curves.values() for s, _ in c})
    by_step = [np.mean([dict(c)[s] for c in curves.values() if s in dict(c)]) for s in steps]
    print("mean over seeds: " + " ".join(f"{s}:{v:.1%}" for s, v in zip(steps, by_step)))


if __name__ == "__main__":
    main()
