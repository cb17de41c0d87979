"""Rollout: run many episodes at once against an engine, in groups, with a ledger."""

from areal_agents.rollout.episodes import RolloutLedger, run_groups
from areal_agents.rollout.held_out import distinct_seeds, evaluate

__all__ = ["RolloutLedger", "distinct_seeds", "evaluate", "run_groups"]
