"""`EnvServerProcess`: ``areal-agents serve-env`` as a child process (tests, benchmarks, ``env.backend=server``).

with EnvServerProcess(workers=2) as server:
    pool = RemoteEnvPool(server.url)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from typing import Any

from areal_agents.errors import ArealAgentsError
from areal_agents.net import free_port, wait_healthy


class EnvServerProcess:
    """Launch ``areal-agents serve-env`` as a child process, wait for /health, stop it on exit.

    with EnvServerProcess(workers=2) as server:
        pool = RemoteEnvPool(server.url)
    """

    def __init__(self, *, port: int | None = None, startup_timeout: float = 60.0, **options: Any) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "areal_agents.cli", "serve-env", "--port", str(self.port)]
        for key, value in options.items():
            values = value if isinstance(value, (list, tuple)) else [value]
            for v in values:
                args += [f"--{key.replace('_', '-')}", str(v)]
        # stderr to a file, not a pipe nobody reads while the server runs: a full pipe would block the server
        self.stderr = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self.stderr, text=True)
        self._wait_healthy(startup_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        if wait_healthy(self.url, timeout, alive=lambda: self.process.poll() is None, poll_s=0.1):
            return
        if self.process.poll() is not None:
            self.stderr.seek(0)
            err = self.stderr.read().strip().splitlines()
            self.stderr.close()
            raise ArealAgentsError(f"env server exited with code {self.process.returncode}: {' | '.join(err[-3:])}")
        self.stop()
        raise ArealAgentsError(f"env server at {self.url} not healthy after {timeout}s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.stderr.close()

    def __enter__(self) -> EnvServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
