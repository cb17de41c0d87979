"""The Python servers (serve-env, serve-model) that the C++ and Java clients talk to: one of each for both."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from sdk_helpers import server_process

from areal_agents.envs.runtime.remote import EnvServerProcess
from areal_agents.net import free_port


@pytest.fixture(scope="session")
def serve_env_url() -> Iterator[str]:
    """The Python env-step server (areal_agents/Arithmetic-v0 and the other built-in envs)."""
    with EnvServerProcess() as server:
        yield server.url


@pytest.fixture(scope="session")
def serve_model_url(tiny_dir) -> Iterator[str]:
    """`areal-agents serve-model` of the tiny model, as a user starts it."""
    url = f"http://127.0.0.1:{free_port()}"
    args = [sys.executable, "-m", "areal_agents.cli", "serve-model", "--model-path", str(tiny_dir)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with server_process([*args, "--port", url.rsplit(":", 1)[1]], url, timeout=180, env=env, stdout=subprocess.DEVNULL):
        yield url
