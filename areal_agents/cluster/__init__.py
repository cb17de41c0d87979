"""Running a training run on a Ray cluster (``launcher: ray``): the same config, the same recipe.

Env-step servers, model servers, rollout workers and data-parallel trainer ranks become Ray actors;
the rollout controller (staleness gate and ledger) and the training loop stay in the driver.
`open_launcher` picks a run's `Launcher` from its config; the recipe (``trainers``) never imports this
package: it is handed the launcher.

Example::

    from areal_agents.cluster import open_launcher
    from areal_agents.trainers.rl_recipe import run_train

    run_train(cfg, launcher=open_launcher(cfg))
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from areal_agents.config import TrainConfig
from areal_agents.errors import ConfigError

if TYPE_CHECKING:
    from areal_agents.trainers.policy_api import Launcher


def open_launcher(cfg: TrainConfig) -> Launcher:
    """The launcher ``cfg.launcher`` names: `LocalLauncher`, or `RayLauncher` (needs Ray installed).
    Nothing starts until the recipe calls its ``start()``."""
    if cfg.launcher != "ray":
        from areal_agents.trainers.local_launcher import LocalLauncher  # noqa: PLC0415  (loads torch)

        return LocalLauncher(cfg)
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("launcher=ray needs Ray, which is not installed: pip install 'areal-agents[ray]'")
    from areal_agents.cluster.ray_launcher import RayLauncher  # noqa: PLC0415  (imports ray)

    return RayLauncher(cfg)


__all__ = ["open_launcher"]
