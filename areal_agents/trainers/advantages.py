"""Group-relative advantages: GRPO, Dr.GRPO and RLOO, plus reward shaping.

For a group of rewards r_1..r_G of one prompt:
    GRPO:     A_i = (r_i - mean(r)) / (std(r) + eps)
    Dr.GRPO:  A_i = r_i - mean(r)        (no std division: it over-weights easy and hard prompts)
    RLOO:     A_i = r_i - (Σ_j r_j - r_i) / (G - 1)
Every loss token of a trajectory gets its trajectory's advantage; the segments of one episode share it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch


def group_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[str],
    method: str = "grpo",
    eps: float = 1e-6,
    episode_ids: Sequence[str] | None = None,
) -> torch.Tensor:
    """Advantages for each trajectory, computed within its group (population std for GRPO).

    With ``episode_ids``, the trajectories of one episode (the segments of a conversation whose chat
    template rewrote history) count once in their group's statistics and share its advantage.
    """
    if method not in ("grpo", "dr_grpo", "rloo"):
        raise ValueError(f"Expects method 'grpo', 'dr_grpo' or 'rloo', got {method!r}")
    episode_ids = list(episode_ids) if episode_ids is not None else [str(i) for i in range(len(rewards))]
    out = torch.zeros(len(rewards), dtype=torch.float64)
    members: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (g, e) in enumerate(zip(group_ids, episode_ids)):
        members[g][e].append(i)
    for episodes in members.values():
        rows = list(episodes.values())
        x = torch.tensor([rewards[idx[0]] for idx in rows], dtype=torch.float64)  # one reward per episode
        if method == "grpo":
            a = (x - x.mean()) / (x.std(unbiased=False) + eps)
        elif method == "dr_grpo":
            a = x - x.mean()
        elif len(rows) > 1:
            a = x - (x.sum() - x) / (len(rows) - 1)
        else:
            a = torch.zeros_like(x)
        for idx, value in zip(rows, a.tolist()):
            out[idx] = value
    return out.float()


def zero_variance_groups(rewards: Sequence[float], group_ids: Sequence[str]) -> set[str]:
    """Groups whose rewards are all equal: their advantages are 0 and they carry no gradient."""
    seen: dict[str, set[float]] = defaultdict(set)
    for r, g in zip(rewards, group_ids):
        seen[g].add(float(r))
    return {g for g, values in seen.items() if len(values) == 1}


def shape_rewards(
    rewards: Sequence[float], scale: float = 1.0, bias: float = 0.0, clip: float | None = None
) -> list[float]:
    """``(r + bias) * scale``, then clipped to ``[-clip, clip]`` if ``clip`` is set."""
    out = [(float(r) + bias) * scale for r in rewards]
    return [max(-clip, min(clip, r)) for r in out] if clip is not None else out
