"""Part c's verdict (bench/gpu_check_parts.py): does accuracy rise over the RL steps, beyond noise?

Each RL step samples fresh problems (the arithmetic env draws new ones per group), so the step's accuracy,
``rollout/accuracy`` in the run's TensorBoard logs, is an unbiased estimate of the policy's accuracy before
that step's update: a held-out figure per step, not one before and one after. The verdict is the least-squares
slope of accuracy on step with a two-sided 95% interval from the residuals (Student's t, k - 2 degrees of
freedom for k steps): rises when the interval is above 0, falls when below, inconclusive otherwise. A
before/after difference of two 200-problem evaluations has a standard error of about 5 points at 50%: with
the few points 30 steps may add, "after > before" is a coin flip; the slope uses every step's samples.
"""

from __future__ import annotations

import math
from pathlib import Path

# Student's t, two-sided 95% (the 97.5% quantile), by degrees of freedom; between rows the smaller df's (wider).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
T_975 |= {12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}
MIN_STEPS = 4  # two degrees of freedom: fewer steps give no interval worth reading


def t_975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (1.96 past 120)."""
    if df < 1:
        raise ValueError(f"df: expects at least 1 degree of freedom, got {df}")
    return T_975[max(k for k in T_975 if k <= df)] if df <= 120 else 1.960


def slope_interval(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least-squares slope of ``ys`` on ``xs``, its standard error and 95% interval, and the fitted rise over
    the span of ``xs`` (slope x (max - min)): ``se = sqrt(sum(residual^2) / (k - 2) / sum((x - mean x)^2))``."""
    k = len(xs)
    if k != len(ys) or k < MIN_STEPS:
        raise ValueError(f"expects {MIN_STEPS} or more (x, y) pairs, got {k} x and {len(ys)} y")
    mx, my = sum(xs) / k, sum(ys) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("expects at least two distinct x")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    se = math.sqrt(residual / (k - 2) / sxx)
    half = t_975(k - 2) * se
    return {
        "slope": slope,
        "slope_se": se,
        "slope_low": slope - half,
        "slope_high": slope + half,
        "rise": slope * (max(xs) - min(xs)),
        "steps": float(k),
    }


def verdict(fit: dict[str, float]) -> str:
    """``rises`` (interval above 0), ``falls`` (below 0) or ``inconclusive``."""
    if fit["slope_low"] > 0:
        return "rises"
    if fit["slope_high"] < 0:
        return "falls"
    return "inconclusive"


def step_scalars(run_dir: Path, tag: str = "rollout/accuracy") -> tuple[list[float], list[float]]:
    """(steps, values) of ``tag`` in ``run_dir/tensorboard``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    scalars = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    if tag not in scalars.Tags()["scalars"]:
        return [], []
    events = scalars.Scalars(tag)
    return [float(e.step) for e in events], [float(e.value) for e in events]
