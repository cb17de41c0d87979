"""What one RL step records besides its update: the reward breakdown, GPU use, the episode ledger's
counts, trajectory dumps; and dynamic sampling's group filter."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from areal_agents.rollout.controller import Group
from areal_agents.rollout.episodes import RolloutLedger
from areal_agents.types import Trajectory


def dump_trajectories(path: Path, trajectories: list[Trajectory]) -> None:
    """The step's training data as JSONL, one trajectory a line (tokens, masks, logprobs, versions, rewards)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for t in trajectories:
            row = dataclasses.asdict(t)
            row["metadata"] = json.loads(json.dumps(t.metadata, default=str))
            f.write(json.dumps(row) + "\n")


def ledger_counts(ledger: RolloutLedger) -> dict[str, int]:
    return {**dataclasses.asdict(ledger), "running": ledger.running}


def reward_breakdown(trajectories: list[Trajectory], default_env: str) -> dict[str, float]:
    """Mean reward per env (``metadata["env"]``, else the run's env id) and of each turn; with several
    agents also per agent (``reward_agent/ID``) and per agent and turn (``reward_turn/ID/K``)."""
    by_env: dict[str, list[float]] = defaultdict(list)
    by_agent: dict[str, list[float]] = defaultdict(list)
    by_turn: dict[tuple[str, int], list[float]] = defaultdict(list)
    for t in trajectories:
        if t.metadata.get("segment", 0) != 0:
            continue  # later segments of an episode repeat its rewards
        by_env[str(t.metadata.get("env", default_env))].append(t.reward)
        by_agent[t.agent_id].append(t.reward)
        for k, r in enumerate(t.turn_rewards):
            by_turn[(t.agent_id, k + 1)].append(r)
    out = {f"reward_env/{env}": float(np.mean(v)) for env, v in by_env.items()}
    if len(by_agent) > 1:
        out |= {f"reward_agent/{a}": float(np.mean(v)) for a, v in sorted(by_agent.items())}
        return out | {f"reward_turn/{a}/{k}": float(np.mean(v)) for (a, k), v in sorted(by_turn.items())}
    return out | {f"reward_turn/{k}": float(np.mean(v)) for (_, k), v in sorted(by_turn.items())}


def gpu_utilisation() -> dict[str, float]:
    """Utilisation (%) of each visible GPU, when there is one and NVML can read it."""
    if not torch.cuda.is_available():
        return {}
    try:
        return {f"gpu{i}_utilisation": float(torch.cuda.utilization(i)) for i in range(torch.cuda.device_count())}
    except Exception:  # noqa: BLE001  (no pynvml / NVML: skip rather than fail a run over a metric)
        return {}


def has_reward_variance(group: Group) -> bool:
    """Dynamic sampling's filter: a group whose rewards are all equal teaches GRPO nothing."""
    return len({t.reward for t in group.trajectories}) > 1
