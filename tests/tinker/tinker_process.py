"""A real ``areal-agents serve-tinker`` process for the tests that drive it with the unmodified SDK or cookbook."""

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from areal_agents.net import free_port

CLIENT_ENV = {"TINKER_API_KEY": "tml-test", "TINKER_TELEMETRY": "0"}  # the SDK wants a tml- key


@contextlib.contextmanager
def serve_tinker(root: Path, base_models: dict[str, Path], nproc: int = 1) -> Iterator[str]:
    """``serve-tinker`` serving ``base_models`` (name -> checkpoint dir) with checkpoints under ``root``, training
    on ``nproc`` FSDP2 ranks (1: in its own process); its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "areal_agents.cli", "serve-tinker", "--checkpoint-root", str(root / "ckpt")]
    cmd += ["--nproc-per-node", str(nproc)]
    cmd += [f"--base-model={name}={path}" for name, path in base_models.items()] + ["--port", str(port)]
    log = root / "server.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert proc.poll() is None, log.read_text()
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
