"""The gateway as a run's rollout source (``rollout.source=gateway``), and as ``serve-gateway``'s whole service:
the server started on the run's engine, its rewarded sessions to the trainer and/or the trajectory store."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from areal_agents.chat import ReplyParser
from areal_agents.config import GatewayConfig, RolloutConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.rollout.episodes import RolloutLedger
from areal_agents.rollout.gateway.server import Gateway
from areal_agents.rollout.gateway.session_book import FinishedSession
from areal_agents.rollout.gateway.source import GatewaySource
from areal_agents.rollout.gateway.store import TrajectoryStore, read_sessions
from areal_agents.types import SamplingParams

_PRUNE_EVERY_S = 3600.0


def open_gateway(
    g: GatewayConfig,
    r: RolloutConfig,
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    on_ready: Callable[[FinishedSession], None],
) -> Gateway:
    """A gateway serving ``engine`` as ``rollout.*`` samples and parses (not started)."""
    return Gateway(
        g,
        engine,
        tokenizer,
        SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k),
        on_ready,
        parser=ReplyParser.for_template(tokenizer.chat_template, r.tool_parser, r.reasoning_parser),
        chat_template_kwargs=r.chat_template_kwargs,
        max_total_tokens=engine.max_context() or 4096,
    )


class LiveSource(GatewaySource):
    """A `GatewaySource` fed by its own running gateway (and store); `aclose` stops them."""

    gateway: Gateway
    store: TrajectoryStore | None = None
    _pruner: asyncio.Task | None = None

    def put(self, session: FinishedSession, replayed: bool = False) -> None:
        super().put(session, replayed)
        if self.store is not None and not replayed:
            self.store.append(session)

    def live_stats(self) -> dict[str, float]:
        """The gateway's counts since start, for the step's metrics (``rollout/gateway_*``)."""
        stats = self.gateway.stats()
        keys = ("opened", "handed_on", "expired", "idle_ended", "calls", "unsessioned_calls", "open_sessions")
        extra = {"stale_dropped": self.stats.groups_stale, "replayed": self.replayed}
        return {f"gateway_{k}": float(v) for k, v in ({k: stats[k] for k in keys} | extra).items()}

    def waiting_line(self, taken: int) -> str:
        stats = self.gateway.stats()
        return (
            f"{super().waiting_line(taken)}: {stats['open_sessions']} sessions open or awaiting a reward, "
            f"{stats['handed_on']} trained or queued, {stats['expired']} expired (clients: {self.gateway.url})"
        )

    async def aclose(self) -> None:
        await super().aclose()
        if self._pruner is not None:
            self._pruner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pruner
            self._pruner = None
        await self.gateway.stop()


async def open_live_source(
    g: GatewayConfig,
    r: RolloutConfig,
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    ledger: RolloutLedger,
    run_dir: Path,
    taken_before: int = 0,
) -> LiveSource:
    """The run's gateway started, its sessions (after those of ``gateway.replay_dir``) its batches; its address
    printed and written to ``run_dir/gateway.json`` (``{"url": ...}``) for the clients to find."""
    replay = list(read_sessions(g.replay_dir)) if g.replay_dir else []
    source = LiveSource(
        r.batch_size,
        engine.get_version,
        max_staleness=r.max_staleness,
        stale_sessions=g.stale_sessions,
        ledger=ledger,
        replay=replay,
        taken_before=taken_before,
    )
    source.gateway = open_gateway(g, r, engine, tokenizer, source.put)
    source.store = TrajectoryStore(g.trajectory_dir, g.retention_hours) if g.trajectory_dir else None
    await source.gateway.start()
    if source.store is not None:
        source._pruner = asyncio.create_task(prune_hourly(source.store))
    announce(source.gateway, run_dir, f"{len(replay)} replayed sessions first; " if replay else "")
    return source


async def prune_hourly(store: TrajectoryStore) -> None:
    """``gateway.retention_hours``: delete old trajectory files now and every hour."""
    while True:
        store.prune()
        await asyncio.sleep(_PRUNE_EVERY_S)


def announce(gateway: Gateway, where: Path, note: str = "") -> dict[str, Any]:
    """Print the gateway's address and write it to ``where/gateway.json``."""
    info = {"url": gateway.url, "openai_base_url": f"{gateway.url}/v1", "anthropic_base_url": gateway.url}
    where.mkdir(parents=True, exist_ok=True)
    (where / "gateway.json").write_text(json.dumps(info) + "\n")
    print(f"gateway: {gateway.url} (OpenAI base_url {gateway.url}/v1, Anthropic base_url {gateway.url}); {note}"
          "sessions: POST /rl/sessions, rewards: POST /rl/sessions/ID/reward", flush=True)  # fmt: skip
    return info
