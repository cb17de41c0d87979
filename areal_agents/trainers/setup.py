"""Deprecated: split into `areal_agents.trainers.optim` and `areal_agents.trainers.run_start`."""

import warnings

from areal_agents.trainers.optim import lr_factor, make_optimizer
from areal_agents.trainers.run_start import held_out_seeds, open_checked_backend, prepare_run_dir, seed_everything

warnings.warn(
    "areal_agents.trainers.setup moved to areal_agents.trainers.optim and areal_agents.trainers.run_start; "
    "the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
__all__ = [
    "held_out_seeds",
    "lr_factor",
    "make_optimizer",
    "open_checked_backend",
    "prepare_run_dir",
    "seed_everything",
]
