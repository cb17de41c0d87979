"""`areal-agents plot`'s figures read well: equal series both visible, a flat series on a nonzero axis,
throughput's two scales on two axes, held-out evaluations as labelled points."""

import matplotlib
import pytest

from areal_agents.trainers.metrics_writer import MetricsWriter
from areal_agents.trainers.plots import FIGURES, draw, plot_run

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STEPS = list(range(1, 41))


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_two_equal_series_are_both_visible():
    """Arithmetic's reward is its accuracy: the two lines coincide, so they differ in style (a wide pale line
    under a narrow dashed one) and the legend says why only one shape shows."""
    values = [0.5 + 0.01 * s for s in STEPS]
    fig = draw(FIGURES["reward"], {"rollout/reward_mean": (STEPS, values), "rollout/accuracy": (STEPS, values)})
    under, over = fig.axes[0].get_lines()
    assert under.get_linewidth() > over.get_linewidth() and under.get_alpha() < 1
    assert under.get_linestyle() == "-" and over.get_linestyle() == "--"
    assert under.get_color() != over.get_color() and over.get_zorder() > under.get_zorder()
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["rollout/reward_mean", "rollout/accuracy (same values as rollout/reward_mean)"]


def test_a_flat_series_gets_an_axis_of_nonzero_span():
    """Staleness 0 at every step (max_staleness 0): the axis runs 0..1 (plus a margin) with integer ticks,
    not ±0.04 about 0; the line is above the frame's bottom edge."""
    zeros = [0.0] * len(STEPS)
    series = {"rollout/staleness_mean": (STEPS, zeros), "rollout/staleness_max": (STEPS, zeros)}
    fig = draw(FIGURES["staleness"], series)
    low, high = fig.axes[0].get_ylim()
    assert low < 0 < 1 < high and high - low < 1.5
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in fig.axes[0].get_yticks())

    constant = draw(FIGURES["reward"], {"rollout/reward_mean": (STEPS, [0.9] * len(STEPS))})
    low, high = constant.axes[0].get_ylim()
    assert low < 0.85 and high > 0.95  # min_span 0.1 about the value


def test_throughput_puts_each_scale_on_its_own_axis():
    """~5,000 tokens/s beside ~1,000 samples/s: two y axes, each from 0, each with its series' colour."""
    fig = draw(
        FIGURES["throughput"],
        {
            "perf/gen_tokens_per_s": (STEPS, [5000.0 + s for s in STEPS]),
            "perf/trained_samples_per_s": (STEPS, [1000.0 + s for s in STEPS]),
        },
    )
    left, right = fig.axes
    assert [line.get_label() for line in left.get_lines()] == ["perf/gen_tokens_per_s"]
    assert [line.get_label() for line in right.get_lines()] == ["perf/trained_samples_per_s"]
    assert left.get_ylim()[0] <= 0 < 5040 < left.get_ylim()[1] < 6000
    assert right.get_ylim()[0] <= 0 < 1040 < right.get_ylim()[1] < 1200
    assert left.yaxis.label.get_color() == left.get_lines()[0].get_color()
    assert right.yaxis.label.get_color() == right.get_lines()[0].get_color()
    assert len(left.get_legend().get_texts()) == 2  # one legend names both


def test_held_out_evaluations_are_labelled_points():
    """Evaluations every 3 steps: a marker at each, its value as a percentage beside it, a percent axis."""
    steps, accuracy = [0, 3, 6, 9], [0.68, 0.80, 0.855, 0.88]
    fig = draw(FIGURES["accuracy"], {"eval/accuracy": (steps, accuracy)})
    (line,) = fig.axes[0].get_lines()
    assert line.get_marker() == "o" and list(line.get_xdata()) == steps
    assert [t.get_text() for t in fig.axes[0].texts] == ["68.0", "80.0", "85.5", "88.0"]
    fig.canvas.draw()
    assert fig.axes[0].get_yticklabels()[1].get_text().endswith("%")


def test_plot_run_writes_each_figure_from_the_run_logs(tmp_path):
    metrics = MetricsWriter(tmp_path / "tensorboard")
    metrics.log(0, {"eval/accuracy": 0.5})
    for step in (1, 2, 3):
        metrics.log(step, {"rollout/reward_mean": 0.5, "rollout/accuracy": 0.5, "rollout/staleness_max": 0.0})
        metrics.log(step, {"perf/gen_tokens_per_s": 5000.0, "perf/trained_samples_per_s": 900.0})
    metrics.log(3, {"eval/accuracy": 0.75})
    metrics.close()
    written = plot_run(tmp_path)
    assert [p.name for p in written] == ["reward.png", "accuracy.png", "staleness.png", "throughput.png"]
    assert all(p.stat().st_size > 10_000 for p in written)
