"""The summary an RL run ends with: ``run_dir/summary.json`` and the lines it prints.

Example::

    summary = write_summary(
        run_dir, accuracy={"before": 0.1, "after": 0.4}, curve=[(0, 0.1), (3, 0.4)], eval_problems=8, steps=(1, 3), ...
    )
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
    curve: list[tuple[int, float]],
    eval_problems: int,
    steps: tuple[int, int],
    version: int,
    wall: float,
    totals: Totals,
    engine_reports: bool,
    ledger: RolloutLedger,
    retries: int,
    checkpoint: Path,
    launcher_stats: dict[str, Any],
) -> dict[str, Any]:
    """Write and print the run's summary; return it.

    Args:
        accuracy: held-out greedy accuracy ``before`` and ``after`` training.
        curve: every held-out evaluation of the run, (step, accuracy), a resumed run's earlier ones included.
        steps: the first and last step this invocation trained (a resumed run starts after its checkpoint);
            ``wall`` and the rates are this invocation's.
        engine_reports: whether the engine's busy time was counted.
    """
    first, last = steps
    summary = {
        "accuracy_before": accuracy["before"],
        "accuracy_after": accuracy["after"],
        "accuracy_curve": [[step, acc] for step, acc in curve],
        "eval_problems": eval_problems,
        "steps": last,  # the run's, from step 1
        "steps_this_run": max(0, last - first + 1),
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
        f"held-out greedy accuracy by step: {format_curve(curve)}\n"
        f"{_steps_done(first, last)} in {wall:.0f} s | {summary['trained_samples_per_s']:.0f} trained samples/s | "
        f"{summary['generated_tokens_per_s']:.0f} generated tokens/s | engine version {version}\n"
        f"checkpoint: {checkpoint}\ntensorboard: {run_dir / 'tensorboard'}"
    )
    return summary


def format_curve(curve: list[tuple[int, float]] | list[list[float]]) -> str:
    """``0: 68.0% | 3: 80.5% | ...``: the held-out curve, step by step."""
    return " | ".join(f"{int(step)}: {acc:.1%}" for step, acc in curve)


def _steps_done(first: int, last: int) -> str:
    """What this invocation trained: "300 steps", or for a resumed run "10 steps (21->30)"."""
    n = max(0, last - first + 1)
    if first == 1 or n == 0:
        return plural(n, "step")
    return f"1 step (step {last})" if n == 1 else f"{n} steps ({first}->{last})"
