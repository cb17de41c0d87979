"""`areal-agents plot RUN_DIR`: PNG curves of a run from its TensorBoard logs, for those who would rather look.

Writes ``RUN_DIR/plots/{reward,accuracy,staleness,throughput}.png`` (each from the tags the run has). Made to
be read: series that coincide stay visible (a wide pale line under a dashed one), a flat series sits on an
axis of a sensible span, quantities of different scale get their own axes, and held-out evaluations are
drawn as points with their values.

Example::

    paths = plot_run("runs/arith/rl")   # [.../plots/reward.png, .../plots/accuracy.png, ...]
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_agents.errors import ArealAgentsError

Series = tuple[list[int], list[float]]  # steps, values


@dataclass(frozen=True)
class FigureSpec:
    """One PNG: its tags and how to draw them."""

    title: str
    tags: tuple[str, ...]
    ylabels: tuple[str, ...]  # one per axis: with ``twin``, the first tag's (left) and the second's (right)
    twin: bool = False  # the second tag on its own right-hand axis: a quantity of another scale
    points: bool = False  # evaluations: a marker per point, each labelled with its value
    percent: bool = False  # values in [0, 1] shown as percentages
    integer: bool = False  # integer ticks (policy versions)
    floor: float | None = None  # the axis starts here when the data do not go below it (counts, rates)
    min_span: float = 0.0  # the axis spans at least this much: a flat series gets a readable axis


FIGURES = {
    "reward": FigureSpec(
        "rollout reward and sampled accuracy",
        ("rollout/reward_mean", "rollout/accuracy"),
        ("batch mean",),
        min_span=0.1,
    ),
    "accuracy": FigureSpec(
        "held-out greedy accuracy",
        ("eval/accuracy",),
        ("accuracy",),
        points=True,
        percent=True,
        min_span=0.1,
    ),
    "staleness": FigureSpec(
        "staleness of trained samples",
        ("rollout/staleness_mean", "rollout/staleness_max"),
        ("policy versions behind",),
        integer=True,
        floor=0.0,
        min_span=1.0,
    ),
    "throughput": FigureSpec(
        "throughput",
        ("perf/gen_tokens_per_s", "perf/trained_samples_per_s"),
        ("generated tokens/s", "trained samples/s"),
        twin=True,
        floor=0.0,
        min_span=1.0,
    ),
}

# The first series wide and pale, the next ones narrow and dashed on top: equal series stay visible.
_STYLES = (
    {"color": "C0", "linewidth": 3.0, "alpha": 0.5, "linestyle": "-", "zorder": 2},
    {"color": "C1", "linewidth": 1.2, "alpha": 1.0, "linestyle": "--", "zorder": 3},
    {"color": "C2", "linewidth": 1.2, "alpha": 1.0, "linestyle": ":", "zorder": 4},
)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the PNGs; return their paths. Raises `ArealAgentsError` if the run has no TensorBoard logs."""
    plt = _pyplot()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    logs = Path(run_dir) / "tensorboard"
    if not logs.is_dir():
        raise ArealAgentsError(f"no TensorBoard logs in {logs} (is {run_dir} a run directory?)")
    scalars = EventAccumulator(str(logs), size_guidance={"scalars": 0}).Reload()
    available = set(scalars.Tags()["scalars"])
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for name, spec in FIGURES.items():
        series = {}
        for tag in spec.tags:
            if tag in available:
                events = scalars.Scalars(tag)
                series[tag] = ([e.step for e in events], [e.value for e in events])
        if not series:
            continue
        fig = draw(spec, series)
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def draw(spec: FigureSpec, series: dict[str, Series]) -> Any:
    """The matplotlib figure of ``spec`` from ``series`` (tag -> steps, values; the tags it has)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    axes = [ax, ax.twinx()] if spec.twin and len(series) > 1 else [ax]
    handles = []
    for i, (tag, (steps, values)) in enumerate(series.items()):
        target = axes[min(i, len(axes) - 1)]
        style = dict(_STYLES[i % len(_STYLES)])
        if len(axes) > 1:  # each axis its own series: full strength, its colour on the axis label
            style.update(linewidth=1.5, alpha=1.0, linestyle="-")
        label = tag + _same_as(tag, series)
        if spec.points:
            style.update(linewidth=1.2, alpha=1.0, marker="o", markersize=5)
        elif len(steps) < 30:
            style["marker"] = "."
        (line,) = target.plot(steps, values, label=label, **style)
        handles.append(line)
        if spec.points:
            _label_points(target, steps, values, spec.percent)
    for i, target in enumerate(axes):
        values = [v for j, (_, vs) in enumerate(series.values()) if min(j, len(axes) - 1) == i for v in vs]
        _set_span(target, values, spec)
        _format_axis(target, spec)
        if i < len(spec.ylabels):
            colour = handles[i].get_color() if len(axes) > 1 else "black"
            target.set_ylabel(spec.ylabels[i], color=colour)
    ax.set(title=spec.title, xlabel="step")
    ax.grid(alpha=0.3)
    ax.legend(handles=handles, loc="best")
    fig.tight_layout()
    return fig


def _same_as(tag: str, series: dict[str, Series]) -> str:
    """The legend's note when an earlier series has exactly these values (say why one line hides), or ""."""
    tags = list(series)
    for other in tags[: tags.index(tag)]:
        if series[other] == series[tag]:
            return f" (same values as {other})"
    return ""


def _label_points(ax: Any, steps: list[int], values: list[float], percent: bool) -> None:
    """Each point's value beside it (every k-th when there are many, and always the last)."""
    every = max(1, -(-len(steps) // 12))
    for k, (x, y) in enumerate(zip(steps, values)):
        if k % every == 0 or k == len(steps) - 1:
            text = f"{100 * y:.1f}" if percent else f"{y:.3g}"
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7)


def _set_span(ax: Any, values: list[float], spec: FigureSpec) -> None:
    """At least ``spec.min_span`` of y (about the data's middle, from ``spec.floor`` when it is above the
    data's low end), and a margin so a line on the edge is not hidden by the frame."""
    if not values:
        return
    lo, hi = min(values), max(values)
    if hi - lo < spec.min_span:
        middle = (lo + hi) / 2
        lo, hi = middle - spec.min_span / 2, middle + spec.min_span / 2
    if spec.floor is not None and min(values) >= spec.floor:
        lo, hi = spec.floor, max(hi, spec.floor + spec.min_span)
    margin = 0.08 * (hi - lo) if hi > lo else 0.5
    ax.set_ylim(lo - margin, hi + margin)


def _format_axis(ax: Any, spec: FigureSpec) -> None:
    from matplotlib.ticker import MaxNLocator, PercentFormatter  # noqa: PLC0415

    if spec.percent:
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    if spec.integer:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _pyplot() -> Any:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as e:
        raise ArealAgentsError("areal-agents plot needs matplotlib: pip install 'areal-agents[plot]'") from e
    return plt
