"""Typed config dataclasses, loaded from a YAML file plus ``a.b=c`` command-line overrides.

cfg = load_config(TrainConfig, "examples/arithmetic/rl.yaml", ["ppo.lr=3e-4"])
"""

from areal_agents.config.engine_section import EngineConfig, EngineOptions
from areal_agents.config.fields import config_field
from areal_agents.config.gateway_section import GatewayConfig
from areal_agents.config.loading import config_diff, config_to_dict, load_config
from areal_agents.config.sections import (
    EnvConfig,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    PolicyConfig,
    PPOConfig,
    RayConfig,
    RolloutConfig,
    SFTConfig,
    TimelineConfig,
    TrainConfig,
)

__all__ = [
    "EngineConfig",
    "EngineOptions",
    "EnvConfig",
    "EvalConfig",
    "GatewayConfig",
    "LoraConfig",
    "ModelConfig",
    "PolicyConfig",
    "PPOConfig",
    "RayConfig",
    "RolloutConfig",
    "SFTConfig",
    "TimelineConfig",
    "TrainConfig",
    "config_diff",
    "config_field",
    "config_to_dict",
    "load_config",
]
