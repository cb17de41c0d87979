"""A user's own reward function and dataset class, named from config as module:Class in tests."""

import os
from dataclasses import dataclass

from areal_agents.data import BaseDataset


class LengthReward:
    """Reward 1 for completions of at most 5 characters."""

    def __call__(self, completion, row):
        return float(len(completion) <= 5)


class Shouting(BaseDataset):
    def to_row(self, index, raw):
        row = super().to_row(index, raw)
        return {**row, "prompt": row["prompt"].upper()}


@dataclass
class DiesOnce:
    """Kills its worker process the first time it runs (``marker`` absent), then scores 1: a worker lost from
    outside (an OOM kill), which is no fault of the completion."""

    marker: str

    def __call__(self, completion, row):
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(9)
        return 1.0
