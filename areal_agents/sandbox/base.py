"""The sandbox API: run untrusted code, get a typed `ExecResult`. Every backend has the same signature.

result = LocalSandbox().run("print(input()[::-1])", stdin="abc", timeout_s=5)
result.status, result.stdout      # ("ok", "cba\\n")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

Status = Literal["ok", "runtime_error", "timeout", "memory_limit", "output_limit", "killed", "sandbox_error"]


@dataclass
class ExecResult:
    """What one execution did. ``status`` says how it ended; ``exit_code`` is negative for a signal."""

    stdout: str
    stderr: str
    exit_code: int | None
    status: Status
    wall_s: float


class Sandbox(Protocol):
    def run(
        self,
        code: str,
        *,
        stdin: str | None = None,
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        files: dict[str, str] | None = None,
        language: str = "python",
    ) -> ExecResult: ...

    async def arun(
        self,
        code: str,
        *,
        stdin: str | None = None,
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        files: dict[str, str] | None = None,
        language: str = "python",
    ) -> ExecResult: ...
