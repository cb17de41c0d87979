"""Trainers: decoupled PPO and SFT (math in small modules, loops in the recipes)."""

from areal_agents.trainers.advantages import group_advantages, zero_variance_groups
from areal_agents.trainers.ppo import ppo_update
from areal_agents.trainers.ppo_loss import decoupled_ppo_loss
from areal_agents.trainers.sft import conversation_to_trajectory, sft_update

__all__ = [
    "conversation_to_trajectory",
    "decoupled_ppo_loss",
    "group_advantages",
    "ppo_update",
    "sft_update",
    "zero_variance_groups",
]
