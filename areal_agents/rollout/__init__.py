"""Rollout: run many episodes at once against an engine, in groups, each through one episode runner
that retries and counts it in a ledger."""

from areal_agents.rollout.episodes import EpisodeRunner, RolloutLedger, failure_kind, local_episode, run_groups
from areal_agents.rollout.held_out import distinct_seeds, evaluate

__all__ = [
    "EpisodeRunner",
    "RolloutLedger",
    "distinct_seeds",
    "evaluate",
    "failure_kind",
    "local_episode",
    "run_groups",
]
