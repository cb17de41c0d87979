"""A user's own reward function and dataset class, named from config as module:Class in tests."""

from areal_agents.data import BaseDataset


class LengthReward:
    """Reward 1 for completions of at most 5 characters."""

    def __call__(self, completion, row):
        return float(len(completion) <= 5)


class Shouting(BaseDataset):
    def to_row(self, index, raw):
        row = super().to_row(index, raw)
        return {**row, "prompt": row["prompt"].upper()}
