"""The e2b backend without its cloud (unreachable here): the runner runs for real, locally, and the
mapping is checked against the SDK's own result types. With E2B_API_KEY set it works unchanged."""

import subprocess
import sys

import pytest

pytest.importorskip("e2b_code_interpreter")
from e2b_code_interpreter.models import Execution, ExecutionError, Logs  # noqa: E402

from areal_agents.sandbox.e2b import E2BSandbox, execution_to_result, runner_source  # noqa: E402
from areal_agents.sandbox.local import SandboxUnavailable  # noqa: E402


def run_runner_here(code, stdin=None, timeout_s=5.0, memory_mb=256, files=None) -> Execution:
    """Execute the runner as the e2b kernel would, and wrap its output in the SDK's Execution type."""
    source = runner_source(code, stdin, timeout_s, memory_mb, files, cap=1 << 16)
    out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=60)
    return Execution(logs=Logs(stdout=[out.stdout], stderr=[out.stderr]))


@pytest.mark.parametrize(
    "code, kwargs, status, stdout",
    [
        ("print(open('d.txt').read() + input())", {"stdin": "!", "files": {"d.txt": "hi"}}, "ok", "hi!\n"),
        ("raise ValueError('x')", {}, "runtime_error", ""),
        ("import time; time.sleep(10)", {"timeout_s": 0.5}, "timeout", ""),
        ("x = bytearray(2 * 1024**3)", {"memory_mb": 128}, "memory_limit", ""),
    ],
)
def test_runner_and_mapping_give_local_statuses(code, kwargs, status, stdout):
    result = execution_to_result(run_runner_here(code, **kwargs), wall_s=0.1)
    assert (result.status, result.stdout) == (status, stdout)


def test_a_kernel_error_is_a_sandbox_error():
    execution = Execution(error=ExecutionError(name="KernelDied", value="oom", traceback=""))
    assert execution_to_result(execution, 0.0).status == "sandbox_error"
    assert execution_to_result(Execution(logs=Logs(stdout=["hello\n"])), 0.0).status == "sandbox_error"


def test_missing_api_key_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(SandboxUnavailable, match="E2B_API_KEY"):
        E2BSandbox()
