"""`ServeGatewayConfig`: ``areal-agents serve-gateway``, a model behind the gateway with no trainer, writing its
rewarded sessions for a later ``train`` (``gateway.replay_dir``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_agents.config.engine_section import EngineConfig
from areal_agents.config.fields import config_field
from areal_agents.config.gateway_section import GatewayConfig
from areal_agents.config.sections import ModelConfig, RolloutConfig


@dataclass
class ServeGatewayConfig:
    """`areal-agents serve-gateway`: serve a model behind the gateway and keep its rewarded sessions on disk."""

    run_dir: str = config_field("where gateway.json (the address) goes", default="runs/gateway")
    seed: int = config_field("sampling seed", default=1)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # sampling and parsers: as the later train's
    gateway: GatewayConfig = field(default_factory=GatewayConfig)

    def __post_init__(self) -> None:
        if not self.model.path:
            raise ValueError("model.path: serve-gateway needs the model to serve")
        if self.model.lora is not None:
            raise ValueError("model.lora: serve-gateway serves whole models; merge the adapter first (export-lora)")
        if not self.gateway.trajectory_dir:
            raise ValueError("gateway.trajectory_dir: serve-gateway keeps the rewarded sessions there; set it")
