"""Metrics to TensorBoard with namespaced keys (``rollout/``, ``train/``, ``eval/``, ``perf/``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch.utils.tensorboard import SummaryWriter


class MetricsWriter:
    """``log(step, {"train/loss": 0.1, ...})`` writes scalars; keeps the latest value of each key.

    ``purge_step``: TensorBoard hides what earlier writers to ``log_dir`` logged at this step and after (a
    resumed run's redone steps replace their first records); None keeps everything."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        self.latest: dict[str, float] = {}
        self.subwriters: dict[str, SummaryWriter] = {}

    def subwriter(self, name: str) -> SummaryWriter:
        """A writer of series that are not indexed by step (TensorBoard shows it as run ``name``); closed with
        this one."""
        if name not in self.subwriters:
            self.subwriters[name] = SummaryWriter(log_dir=str(self.log_dir / name))
        return self.subwriters[name]

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
            self.latest[key] = value

    def histogram(self, step: int, key: str, values: list[float]) -> None:
        if values:
            self.writer.add_histogram(key, np.asarray(values, dtype=np.float64), step)

    def image(self, step: int, key: str, rgb: np.ndarray) -> None:
        """An (H, W, 3) uint8 picture (TensorBoard's Images tab)."""
        self.writer.add_image(key, rgb, step, dataformats="HWC")

    def close(self) -> None:
        for writer in (self.writer, *self.subwriters.values()):
            writer.flush()
            writer.close()


def prefixed(prefix: str, stats: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{k}": v for k, v in stats.items()}
