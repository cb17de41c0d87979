"""The ``gateway`` section: live agent traffic served and captured for training (``rollout.source=gateway``,
``areal-agents serve-gateway``; docs/gateway.md)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal

from areal_agents.config.fields import check_positive, config_field


@dataclass
class GatewayConfig:
    host: str = config_field(
        "address the gateway binds; anything but loopback needs api_keys_file (no open endpoint on a network)",
        default="127.0.0.1",
    )
    port: int = config_field("the gateway's port; 0 = a free one (printed at start)", default=8400)
    api_keys_file: str = config_field(
        "YAML or JSON: API key -> {name, requests_per_minute, tokens_per_minute} (0 = no limit); empty = no keys "
        "(loopback only)",
        default="",
    )
    reward_timeout_s: float = config_field(
        "a session with no reward this long after it ended (or after its last call, if never ended) is dropped "
        "and counted (rollout/gateway_expired)",
        default=3600.0,
    )
    session_idle_s: float = config_field(
        "a session with no call this long is ended by the gateway (its reward may still come)", default=600.0
    )
    max_open_sessions: int = config_field("sessions open or waiting for a reward at once (429 past it)", default=4096)
    max_calls_per_session: int = config_field("model calls one session may make (429 past it)", default=256)
    max_body_bytes: int = config_field("largest request body (413 past it)", default=4 << 20)
    stale_sessions: Literal["drop", "correct"] = config_field(
        "a session whose oldest token is more than rollout.max_staleness versions behind when its batch forms: "
        "drop it (counted), or train it with the decoupled loss's behavior-ratio correction (ppo.behav_imp_weight_cap)",
        default="drop",
    )
    baseline_decay: float = config_field(
        "ppo.advantage=baseline: the running per-task reward baseline b <- d*b + (1-d)*r", default=0.9
    )
    trajectory_dir: str = config_field(
        "opt-in retention: rewarded sessions appended as JSONL here (serve-gateway needs it); empty = none on disk",
        default="",
    )
    retention_hours: float = config_field(
        "trajectory files older than this are deleted (checked hourly and at start); 0 = kept", default=0.0
    )
    replay_dir: str = config_field(
        "train: first take the sessions a serve-gateway wrote here (then live traffic); empty = live only",
        default="",
    )

    def __post_init__(self) -> None:
        check_positive(self, "reward_timeout_s", "session_idle_s", "max_open_sessions", "max_calls_per_session")
        check_positive(self, "max_body_bytes")
        check_positive(self, "port", "retention_hours", or_zero=True)
        if not 0 <= self.baseline_decay < 1:
            raise ValueError(f"baseline_decay: expects a value in [0, 1), got {self.baseline_decay!r}")
        if not self.api_keys_file and not is_loopback(self.host):
            raise ValueError(
                f"host: {self.host!r} is reachable from other machines; set api_keys_file (one key per client) "
                "or bind 127.0.0.1"
            )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
