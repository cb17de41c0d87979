"""Trainers: decoupled PPO and SFT (math in small modules, loops in the recipes).

The names below load on first use, so that `areal-agents` reaches its small modules (a run directory's
checks, say) without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "conversation_to_trajectory": "sft",
    "decoupled_ppo_loss": "ppo_loss",
    "group_advantages": "advantages",
    "ppo_update": "ppo",
    "sft_update": "sft",
    "zero_variance_groups": "advantages",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
