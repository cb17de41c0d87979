"""`E2BSandbox`: the same `Sandbox` API on e2b cloud sandboxes (``pip install 'areal-agents[e2b]'``).

Needs ``E2B_API_KEY`` (and ``E2B_DOMAIN`` for a self-hosted e2b). Each run creates a sandbox, executes a
small runner with ``AsyncSandbox.run_code``: it writes the files, runs the program in a subprocess with the
stdin, a wall-clock timeout and an address-space limit, and prints one JSON record, so statuses mean
exactly what they mean for `LocalSandbox`. The cloud is unreachable from this project's machines: the
tests check the runner for real and the mapping against the SDK's own result types.

    result = E2BSandbox().run("print(1)")          # ExecResult(stdout="1\\n", status="ok", ...)
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from areal_agents.sandbox.base import ExecResult
from areal_agents.sandbox.local import SandboxUnavailable, _status

RECORD = "__AREAL_E2B_RECORD__"

_RUNNER = """
import json, os, resource, subprocess, sys, tempfile
_spec = json.loads({spec!r})
_dir = tempfile.mkdtemp()
for _name, _content in _spec["files"].items():
    with open(os.path.join(_dir, _name), "w") as _f:
        _f.write(_content)
def _limits():
    _mem = _spec["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
try:
    _p = subprocess.run([sys.executable, "main.py"], cwd=_dir, input=_spec["stdin"].encode(), capture_output=True,
                        timeout=_spec["timeout_s"], preexec_fn=_limits)
    _rec = {{"stdout": _p.stdout[:_spec["cap"]].decode(errors="replace"),
             "stderr": _p.stderr[:_spec["cap"]].decode(errors="replace"), "exit_code": _p.returncode,
             "overflow": len(_p.stdout) + len(_p.stderr) > _spec["cap"], "timed_out": False}}
except subprocess.TimeoutExpired as _e:
    _rec = {{"stdout": (_e.stdout or b"")[:_spec["cap"]].decode(errors="replace"),
             "stderr": (_e.stderr or b"")[:_spec["cap"]].decode(errors="replace"), "exit_code": -9,
             "overflow": False, "timed_out": True}}
print({record!r} + json.dumps(_rec))
"""


def runner_source(
    code: str, stdin: str | None, timeout_s: float, memory_mb: int, files: dict[str, str] | None, cap: int
) -> str:
    """The program `run_code` executes in the e2b sandbox for one `run`."""
    spec = {
        "files": {**(files or {}), "main.py": code},
        "stdin": stdin or "",
        "timeout_s": timeout_s,
        "memory_mb": memory_mb + 64,
        "cap": cap,
    }
    return _RUNNER.format(spec=json.dumps(spec), record=RECORD)


def execution_to_result(execution: Any, wall_s: float) -> ExecResult:
    """Map an e2b ``Execution`` (logs, error) to an `ExecResult`."""
    if execution.error is not None:
        message = f"{execution.error.name}: {execution.error.value}"
        return ExecResult("", f"e2b runner failed: {message}", None, "sandbox_error", wall_s)
    lines = "".join(execution.logs.stdout).splitlines()
    records = [line for line in lines if line.startswith(RECORD)]
    if not records:
        return ExecResult("", "e2b runner printed no record", None, "sandbox_error", wall_s)
    rec = json.loads(records[-1][len(RECORD) :])
    status = _status(rec["exit_code"], rec["stderr"], rec["overflow"], rec["timed_out"], sandbox=False)
    return ExecResult(rec["stdout"], rec["stderr"], rec["exit_code"], status, wall_s)


class E2BSandbox:
    """Runs each execution in a fresh e2b sandbox."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        domain: str | None = None,
        template: str | None = None,
        max_output_bytes: int = 1 << 20,
    ) -> None:
        try:
            import e2b_code_interpreter  # noqa: F401
        except ImportError:
            raise SandboxUnavailable("the e2b backend needs its SDK: pip install 'areal-agents[e2b]'") from None
        self.api_key = api_key or os.environ.get("E2B_API_KEY")
        if not self.api_key:
            raise SandboxUnavailable("the e2b backend needs an API key: set E2B_API_KEY (or pass api_key=)")
        self.domain = domain or os.environ.get("E2B_DOMAIN")
        self.template, self.max_output_bytes = template, max_output_bytes

    async def arun(
        self,
        code: str,
        *,
        stdin: str | None = None,
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        files: dict[str, str] | None = None,
        language: str = "python",
    ) -> ExecResult:
        from e2b_code_interpreter import AsyncSandbox, TimeoutException

        if language != "python":
            raise ValueError(f"E2BSandbox runs language 'python', got {language!r}")
        start = time.perf_counter()
        options: dict[str, Any] = {"api_key": self.api_key, "timeout": int(timeout_s) + 60}
        if self.domain:
            options["domain"] = self.domain
        try:
            sandbox = await AsyncSandbox.create(template=self.template, **options)
        except Exception as e:
            return ExecResult(
                "", f"e2b: cannot create a sandbox: {e}", None, "sandbox_error", time.perf_counter() - start
            )
        try:
            source = runner_source(code, stdin, timeout_s, memory_mb, files, self.max_output_bytes)
            execution = await sandbox.run_code(source, timeout=timeout_s + 30)
            return execution_to_result(execution, time.perf_counter() - start)
        except TimeoutException:
            return ExecResult("", "", None, "timeout", time.perf_counter() - start)
        except Exception as e:
            return ExecResult("", f"e2b: {type(e).__name__}: {e}", None, "sandbox_error", time.perf_counter() - start)
        finally:
            await sandbox.kill()

    def run(self, code: str, **kwargs: Any) -> ExecResult:
        return asyncio.run(self.arun(code, **kwargs))
