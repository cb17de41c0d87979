"""`areal-agents plot RUN_DIR`: PNG curves of a run from its TensorBoard logs, for those who would rather look.

Writes ``RUN_DIR/plots/{reward,accuracy,staleness,throughput}.png`` (each from the tags the run has).
"""

from __future__ import annotations

from pathlib import Path

from areal_agents.errors import ArealAgentsError

FIGURES = {
    "reward": ("rollout reward and sampled accuracy", ["rollout/reward_mean", "rollout/accuracy"]),
    "accuracy": ("held-out greedy accuracy", ["eval/accuracy"]),
    "staleness": ("staleness of trained samples (versions)", ["rollout/staleness_mean", "rollout/staleness_max"]),
    "throughput": ("throughput", ["perf/gen_tokens_per_s", "perf/trained_samples_per_s"]),
}


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the PNGs; return their paths. Raises `ArealAgentsError` if the run has no TensorBoard logs."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as e:
        raise ArealAgentsError("areal-agents plot needs matplotlib: pip install 'areal-agents[plot]'") from e
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    logs = Path(run_dir) / "tensorboard"
    if not logs.is_dir():
        raise ArealAgentsError(f"no TensorBoard logs in {logs} (is {run_dir} a run directory?)")
    scalars = EventAccumulator(str(logs), size_guidance={"scalars": 0}).Reload()
    available = set(scalars.Tags()["scalars"])
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for name, (title, tags) in FIGURES.items():
        present = [t for t in tags if t in available]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for tag in present:
            events = scalars.Scalars(tag)
            marker = "." if len(events) < 30 else None
            ax.plot([e.step for e in events], [e.value for e in events], label=tag, marker=marker)
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
