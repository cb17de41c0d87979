"""A server subprocess for the SDK tests: healthy, or the test fails showing what the server said."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from areal_agents.net import wait_healthy


@contextmanager
def server_process(args: list[str], url: str, *, timeout: float = 60, **popen) -> Iterator[subprocess.Popen]:
    """``args`` started and answering ``url``/health within ``timeout`` s (else the test fails, showing what the
    server wrote to stderr); stopped on exit. Its stdout is a pipe unless ``popen`` says otherwise."""
    with tempfile.TemporaryFile("w+") as stderr:
        popen = {"stdout": subprocess.PIPE, "text": True, **popen}
        process = subprocess.Popen(args, stderr=stderr, **popen)
        try:
            if not wait_healthy(url, timeout, alive=lambda: process.poll() is None, poll_s=0.05):
                stderr.seek(0)
                pytest.fail(f"{' '.join(args[:4])} did not become healthy at {url}:\n{stderr.read()[-3000:]}")
            yield process
        finally:
            stop(process)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    if process.stdout:
        process.stdout.close()
