"""Group-relative advantages: GRPO (normalised by the group's std) and RLOO (leave-one-out baseline).

For a group of rewards r_1..r_G of one prompt:
    GRPO:  A_i = (r_i - mean(r)) / (std(r) + eps)
    RLOO:  A_i = r_i - (Σ_j r_j - r_i) / (G - 1)
Every loss token of a trajectory gets its trajectory's advantage.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[str], method: str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """Advantages for each trajectory, computed within its group (population std for GRPO)."""
    if method not in ("grpo", "rloo"):
        raise ValueError(f"Expects method 'grpo' or 'rloo', got {method!r}")
    r = torch.tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(r)
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    for idx in members.values():
        x = r[idx]
        if method == "grpo":
            out[idx] = (x - x.mean()) / (x.std(unbiased=False) + eps)
        elif len(idx) > 1:
            out[idx] = x - (x.sum() - x) / (len(idx) - 1)
    return out.float()


def zero_variance_groups(rewards: Sequence[float], group_ids: Sequence[str]) -> set[str]:
    """Groups whose rewards are all equal: their advantages are 0 and they carry no gradient."""
    seen: dict[str, set[float]] = defaultdict(set)
    for r, g in zip(rewards, group_ids):
        seen[g].add(float(r))
    return {g for g, values in seen.items() if len(values) == 1}
