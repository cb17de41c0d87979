"""The workers x time utilisation heatmap of a timeline, as an RGB image (TensorBoard's image tab, the docs):
one row per worker (engines, trainers, env workers, reward, GPUs), its busy share per bin as colour (viridis:
dark idle, yellow busy), grey where the worker recorded nothing. Drawn with numpy and Pillow in milliseconds,
so a run can draw one every step.

Example::

    image = heatmap_image(read_timeline(run_dir), title="step 12")   # (H, W, 3) uint8
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from areal_agents.timeline.reader import RunTimeline

ROW_ORDER = ("engine", "trainer", "env", "reward", "gpu")  # rows grouped by kind, in the order work flows
# viridis at 0, 1/8, ..., 1 (matplotlib's table), interpolated between
_VIRIDIS = np.array(
    [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
     [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]], dtype=np.float64,
)  # fmt: skip
_GREY, _WHITE, _INK = (208, 208, 208), (255, 255, 255), (40, 40, 40)
ROW_PX, CHAR_PX = 16, 6


def row_order(workers: list[str]) -> list[str]:
    """Workers grouped by kind (`ROW_ORDER`, others last), by name within a kind."""

    def key(worker: str) -> tuple[int, str]:
        kind = worker.split(":")[-1].split("/")[0].rstrip("0123456789")
        return (ROW_ORDER.index(kind) if kind in ROW_ORDER else len(ROW_ORDER), worker)

    return sorted(workers, key=key)


def colours(shares: np.ndarray) -> np.ndarray:
    """Busy shares (0..1, NaN unknown) as RGB (..., 3) uint8."""
    x = np.clip(np.nan_to_num(shares, nan=0.0), 0, 1) * (len(_VIRIDIS) - 1)
    low = np.minimum(np.floor(x).astype(int), len(_VIRIDIS) - 2)
    frac = (x - low)[..., None]
    rgb = _VIRIDIS[low] * (1 - frac) + _VIRIDIS[low + 1] * frac
    rgb[np.isnan(shares)] = _GREY
    return rgb.round().astype(np.uint8)


def heatmap_image(tl: RunTimeline, title: str = "", width: int = 720) -> np.ndarray:
    """``tl``'s busy rows as an image ``width`` pixels wide (the bins averaged down to the plot's columns)."""
    rows = row_order(list(tl.busy)) or ["(no worker recorded)"]
    label_px = CHAR_PX * max(len(r) for r in rows) + 12
    plot_w = max(width - label_px - 60, 100)
    coarse = tl.coarse(plot_w)
    grid = np.array([coarse.busy[r] for r in rows]) if tl.busy and coarse.bins else np.full((1, 1), np.nan)
    cells = Image.fromarray(colours(grid)).resize((plot_w, ROW_PX * len(rows)), Image.NEAREST)
    top, height = 18, 18 + ROW_PX * len(rows) + 28
    canvas = Image.new("RGB", (label_px + plot_w + 60, height), _WHITE)
    canvas.paste(cells, (label_px, top))
    draw = ImageDraw.Draw(canvas)
    draw.text((label_px, 3), title or "busy share per worker", fill=_INK)
    for i, row in enumerate(rows):
        draw.text((4, top + i * ROW_PX + 2), row, fill=_INK)
    _time_axis(draw, label_px, top + ROW_PX * len(rows), plot_w, max(coarse.bins, 1) * coarse.dt)
    _colour_bar(canvas, draw, label_px + plot_w + 12, top, ROW_PX * len(rows))
    return np.asarray(canvas)


def _time_axis(draw: ImageDraw.ImageDraw, x0: int, y0: int, plot_w: int, seconds: float) -> None:
    """Ticks at a round step of seconds under the plot, and the unit."""
    step = next((s for s in (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600) if seconds / s <= 6), 7200)
    t = 0.0
    while t <= seconds + 1e-9:
        x = x0 + int(plot_w * t / max(seconds, 1e-9))
        draw.line([(x, y0), (x, y0 + 3)], fill=_INK)
        draw.text((x - 4, y0 + 5), f"{t:g}", fill=_INK)
        t += step
    draw.text((x0 + plot_w - 50, y0 + 15), "seconds", fill=_INK)


def _colour_bar(canvas: Image.Image, draw: ImageDraw.ImageDraw, x: int, y: int, h: int) -> None:
    """The scale: busy (1) at the top, idle (0) at the bottom."""
    ramp = colours(np.linspace(1, 0, max(h, 2))[:, None].repeat(10, axis=1))
    canvas.paste(Image.fromarray(ramp), (x, y))
    draw.text((x + 13, y - 2), "1", fill=_INK)
    draw.text((x + 13, y + h - 10), "0", fill=_INK)
