"""The workers x time utilisation heatmap of a timeline, as an RGB image (TensorBoard's image tab, the docs):
one row per worker (engines, trainers, env workers, reward, GPUs), its busy share per bin as colour, grey
where the worker recorded nothing.

Example::

    image = heatmap_image(read_timeline(run_dir), title="step 12")   # (H, W, 3) uint8
"""

from __future__ import annotations

import numpy as np

from areal_agents.timeline.reader import RunTimeline

ROW_ORDER = ("engine", "trainer", "env", "reward", "gpu")  # rows grouped by kind, in the order work flows


def row_order(workers: list[str]) -> list[str]:
    """Workers grouped by kind (`ROW_ORDER`, others last), by name within a kind."""

    def key(worker: str) -> tuple[int, str]:
        kind = worker.split(":")[-1].split("/")[0].rstrip("0123456789")
        return (ROW_ORDER.index(kind) if kind in ROW_ORDER else len(ROW_ORDER), worker)

    return sorted(workers, key=key)


def heatmap_image(tl: RunTimeline, title: str = "", max_bins: int = 600, width_in: float = 10.0) -> np.ndarray:
    """``tl``'s busy rows as an image: at most ``max_bins`` columns (means of whole groups of bins)."""
    import matplotlib  # noqa: PLC0415  (heavy: only when an image is drawn)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    coarse = tl.coarse(max_bins)
    workers = row_order(list(coarse.busy))
    grid = np.array([coarse.busy[w] for w in workers]) if workers and coarse.bins else np.full((1, 1), np.nan)
    rows = workers or ["(no worker recorded)"]
    fig, ax = plt.subplots(figsize=(width_in, 1.2 + 0.32 * len(rows)), dpi=80)
    try:
        cmap = plt.get_cmap("viridis").with_extremes(bad="#d0d0d0")
        span = max(coarse.bins, 1) * coarse.dt
        shown = ax.imshow(
            np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, vmin=0, vmax=1,
            interpolation="nearest", extent=(0, span, len(rows) - 0.5, -0.5),
        )  # fmt: skip
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.set_xlabel("seconds")
        ax.set_title(title or "busy share per worker", fontsize=10)
        fig.colorbar(shown, ax=ax, fraction=0.03, pad=0.01, label="busy")
        fig.tight_layout()
        fig.canvas.draw()
        return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    finally:
        plt.close(fig)
