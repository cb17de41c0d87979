"""``areal-agents serve-gateway``: the gateway on a model of its own, no trainer; rewarded sessions go to
``gateway.trajectory_dir`` for a later ``train`` to replay (``gateway.replay_dir``). SIGINT or SIGTERM stop it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

from areal_agents.config.gateway_service import ServeGatewayConfig
from areal_agents.engines.local_servers import open_engine
from areal_agents.models.loading import load_tokenizer, quiet_transformers
from areal_agents.rollout.gateway.live import announce, open_gateway, prune_hourly
from areal_agents.rollout.gateway.store import TrajectoryStore


def serve_gateway(cfg: ServeGatewayConfig) -> None:
    """Serve until a signal; print how many sessions were kept."""
    quiet_transformers()
    asyncio.run(_serve(cfg))


async def _serve(cfg: ServeGatewayConfig) -> None:
    run_dir = Path(cfg.run_dir)
    tokenizer = load_tokenizer(cfg.model.path)
    store = TrajectoryStore(cfg.gateway.trajectory_dir, cfg.gateway.retention_hours)
    engine, servers = open_engine(cfg.engine, cfg.model.path, cfg.model.dtype, run_dir=run_dir, seed=cfg.seed)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    gateway = open_gateway(cfg.gateway, cfg.rollout, engine, tokenizer, store.append)
    pruner = None
    try:
        await gateway.start()
        pruner = asyncio.create_task(prune_hourly(store))
        announce(gateway, run_dir, f"rewarded sessions to {store.directory}; ")
        await stop.wait()
    finally:
        if pruner is not None:
            pruner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pruner
        await gateway.stop()
        await engine.aclose()
        if servers is not None:
            servers.stop()
        counts = gateway.book.counts
        print(f"serve-gateway: stopped; {store.written} sessions kept, {counts.expired} expired, "
              f"{len(gateway.book.sessions)} still open (dropped)", flush=True)  # fmt: skip
