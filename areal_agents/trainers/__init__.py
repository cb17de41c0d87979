"""Trainers: decoupled PPO and SFT (math in small modules, loops in the recipes).

The names below load on first use, so that `areal-agents` reaches its small modules (a run directory's
checks, say) without importing torch.
"""

from __future__ import annotations

from areal_agents.importing import lazy_exports

_HOMES = {
    "conversation_to_trajectory": "sft",
    "decoupled_ppo_loss": "ppo_loss",
    "group_advantages": "advantages",
    "ppo_update": "ppo",
    "sft_update": "sft",
    "zero_variance_groups": "advantages",
}
__all__ = sorted(_HOMES)


__getattr__ = lazy_exports(__name__, _HOMES)
