"""`serve_model`: load the model, build the app and run it under uvicorn until SIGTERM or SIGINT, which end
the process within `EXIT_DEADLINE_S` seconds whatever its decode thread is doing."""

from __future__ import annotations

import gc
import os
import sys
import threading
from typing import Any

from areal_agents.engines.hf.engine import HFEngine
from areal_agents.engines.model_server.routes import build_app
from areal_agents.engines.model_server.server import ModelServerConfig
from areal_agents.timeline import timeline_from_env

SHUTDOWN_GRACE_S = 2.0  # on SIGTERM, requests in flight get this long to finish, then are cancelled
EXIT_DEADLINE_S = 8.0  # ... and if the process is still there after this long, it exits anyway


def serve_model(cfg: ModelServerConfig, device: str = "cpu") -> None:
    """Load the model and serve it on ``device`` (``cpu``, ``cuda`` or ``auto``) until interrupted (the
    `serve-model` command)."""
    import uvicorn  # noqa: PLC0415

    from areal_agents.models import load_model, load_tokenizer  # noqa: PLC0415

    timeline_from_env(f"serve-model-{cfg.port}")  # started by a run: the engine's busy time joins its timeline
    model = load_model(cfg.model_path, cfg.dtype)
    tokenizer = load_tokenizer(cfg.tokenizer_path or cfg.model_path)
    engine = HFEngine.of(model, cfg.engine, seed=cfg.seed, device=device)
    app = build_app(engine, tokenizer, cfg)
    gc.freeze()  # the model's and libraries' objects: no collection walks them again (a large body's parse runs many)
    where = f"{cfg.model_path} on {engine.placement.device}"
    print(f"serve-model: {where}, http://{cfg.host}:{cfg.port} (SGLang native API)", flush=True)
    config = uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE_S
    )
    server = _deadline_server(uvicorn.Server)(config)
    server.run()
    if not server.started:
        sys.exit(3)  # uvicorn.run's exit code when the server could not start (e.g. the port is taken)


def _deadline_server(base: type) -> type:
    """``base`` (uvicorn's `Server`), which exits the process `EXIT_DEADLINE_S` after the first SIGTERM or
    SIGINT if the graceful shutdown has not ended it by then (e.g. a request stuck in a hung engine)."""

    class DeadlineServer(base):
        _deadline: threading.Timer | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            if self._deadline is None:
                self._deadline = threading.Timer(EXIT_DEADLINE_S, _exit_now, (128 + int(sig),))
                self._deadline.daemon = True
                self._deadline.start()

    return DeadlineServer


def _exit_now(code: int) -> None:
    print(f"serve-model: still running {EXIT_DEADLINE_S:.0f}s after the signal to stop; exiting", file=sys.stderr)
    sys.stderr.flush()
    os._exit(code)
