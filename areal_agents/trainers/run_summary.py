"""The summary an RL run ends with: ``run_dir/summary.json`` and the lines it prints.

Example::

    summary = write_summary(run_dir, accuracy={"before": 0.1, "after": 0.4}, eval_problems=8, steps=3, ...)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areal_agents.progress import plural
from areal_agents.rollout.episodes import RolloutLedger
from areal_agents.trainers.step_metrics import Totals


def write_summary(
    run_dir: Path,
    *,
    accuracy: dict[str, float],
    eval_problems: int,
    steps: int,
    version: int,
    wall: float,
    totals: Totals,
    engine_reports: bool,
    ledger: RolloutLedger,
    retries: int,
    checkpoint: Path,
    launcher_stats: dict[str, Any],
) -> dict[str, Any]:
    """Write and print the run's summary (``accuracy``: held-out greedy accuracy ``before`` and ``after``;
    ``engine_reports``: whether the engine's busy time was counted); return it."""
    summary = {
        "accuracy_before": accuracy["before"],
        "accuracy_after": accuracy["after"],
        "eval_problems": eval_problems,
        "steps": steps,
        "engine_version": version,
        "wall_seconds": wall,
        "trained_samples_per_s": totals.trained_samples / max(totals.train_seconds, 1e-9),
        # end to end over the training steps (rollout waits + training + weight pushes), evals excluded
        "samples_per_s": totals.consumed_samples / max(totals.step_seconds, 1e-9),
        "generated_tokens_per_s": totals.generated_tokens / max(totals.rollout_seconds, 1e-9),
        # trajectories with a generation stopped at its token budget (or out of context), over the training steps
        "truncated_fraction": totals.truncated_samples / max(totals.consumed_samples, 1),
        # where the training steps' time went: the trainer busy (the rest it waited for rollouts), and the
        # share of it the engine was busy decoding (None for an engine without counters)
        "step_seconds": totals.step_seconds,
        "train_seconds": totals.train_seconds,
        "engine_busy_fraction": (
            totals.engine_busy_seconds / max(totals.step_seconds, 1e-9) if engine_reports else None
        ),
        "episodes": ledger.counts(),
        "episode_retries": retries,  # env, engine or worker failures run again
        "checkpoint": str(checkpoint),
    }
    if launcher_stats:
        summary["cluster"] = launcher_stats
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"held-out greedy accuracy after RL:  {accuracy['after']:.1%}  "
        f"(before {accuracy['before']:.1%}, {plural(eval_problems, 'problem')})\n"
        f"{plural(steps, 'step')} in {wall:.0f}s | {summary['trained_samples_per_s']:.0f} trained samples/s | "
        f"{summary['generated_tokens_per_s']:.0f} generated tokens/s | engine version {version}\n"
        f"checkpoint: {checkpoint}\ntensorboard: {run_dir / 'tensorboard'}"
    )
    return summary
