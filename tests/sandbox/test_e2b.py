"""The e2b backend without its cloud (unreachable here): the runner runs for real, locally, the mapping is
checked against the SDK's own result types, and `arun` runs against a fake ``AsyncSandbox`` subclass of
the SDK's class. With E2B_API_KEY set it works unchanged."""

import asyncio
import inspect
import os
import subprocess
import sys

import pytest

e2b_code_interpreter = pytest.importorskip("e2b_code_interpreter")
from e2b.connection_config import ApiParams  # noqa: E402
from e2b_code_interpreter import AsyncSandbox, TimeoutException  # noqa: E402
from e2b_code_interpreter.models import Execution, ExecutionError, Logs  # noqa: E402

from areal_agents.sandbox.e2b import E2BSandbox, execution_to_result, runner_source  # noqa: E402
from areal_agents.sandbox.local import SandboxUnavailable  # noqa: E402

# Run as root, the runner drops programs to a uid and kills that uid's processes after each run: give the
# tests their own (LocalSandbox uses 61000 + slot), and an interpreter every uid can run (/root is closed).
TEST_UID = 62000 + os.getpid() % 2000
PYTHON = "/usr/bin/python3" if os.getuid() == 0 else sys.executable


def run_runner_here(code, stdin=None, timeout_s=5.0, memory_mb=256, files=None, **limits) -> Execution:
    """Execute the runner as the e2b kernel would, and wrap its output in the SDK's Execution type."""
    source = runner_source(code, stdin, timeout_s, memory_mb, files, cap=1 << 16, uid=TEST_UID, **limits)
    out = subprocess.run([PYTHON, "-c", source], capture_output=True, text=True, timeout=60)
    return Execution(logs=Logs(stdout=[out.stdout], stderr=[out.stderr]))


@pytest.mark.process
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


def live_processes(uid):
    """Pids of ``uid`` that still run (killed ones wait as zombies until their new parent reaps them)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            if os.stat(f"/proc/{pid}").st_uid == uid and state not in "ZX":
                found.append(pid)
        except OSError:
            pass
    return found


LIMITS_PROGRAM = """
import os, resource, subprocess
print(resource.getrlimit(resource.RLIMIT_NPROC)[0], resource.getrlimit(resource.RLIMIT_FSIZE)[0])
procs = []
try:
    for _ in range(40):
        procs.append(subprocess.Popen(["sleep", "30"]))
except OSError as e:
    print("fork refused:", type(e).__name__)
print("started", len(procs))
try:
    with open(os.path.join(os.environ["TMPDIR"], "big"), "wb") as f:
        f.write(b"x" * (3 << 20))
except OSError as e:
    print("write refused:", e.strerror)
"""


@pytest.mark.process
def test_runner_limits_processes_and_file_size_and_leaves_nothing_running():
    result = execution_to_result(run_runner_here(LIMITS_PROGRAM, max_processes=8, max_file_mb=1), wall_s=0.1)
    limits, *lines = result.stdout.splitlines()
    nproc, fsize = map(int, limits.split())
    assert fsize == 1 << 20 and "write refused: File too large" in lines
    started = int(next(line for line in lines if line.startswith("started")).split()[1])
    assert started < 40 and any(line.startswith("fork refused") for line in lines)
    if os.getuid() == 0:  # the program ran as TEST_UID, alone: its limit is max_processes, its sleeps are gone
        assert nproc == 8 and started < 8 and live_processes(TEST_UID) == []


def test_a_kernel_error_is_a_sandbox_error():
    execution = Execution(error=ExecutionError(name="KernelDied", value="oom", traceback=""))
    assert execution_to_result(execution, 0.0).status == "sandbox_error"
    assert execution_to_result(Execution(logs=Logs(stdout=["hello\n"])), 0.0).status == "sandbox_error"


def test_missing_api_key_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(SandboxUnavailable, match="E2B_API_KEY"):
        E2BSandbox()


class FakeAsyncSandbox(AsyncSandbox):
    """A fake cloud sandbox: the SDK's AsyncSandbox with `create`, `run_code` and `kill` replaced. Calls
    must fit the SDK's own signatures; run_code runs the runner here and answers with the SDK's Execution
    (or raises its TimeoutException). A runner carrying KERNEL_DIES gets a kernel error instead."""

    KERNEL_DIES = "__fake_kernel_dies__"
    RUNNER_HANGS = "__fake_runner_hangs__"
    made: list = []

    @classmethod
    async def create(cls, **kwargs):
        bound = inspect.signature(AsyncSandbox.create).bind(**kwargs)  # TypeError on a parameter the SDK lacks
        assert set(bound.arguments.get("opts", {})) <= set(ApiParams.__annotations__)
        sandbox = object.__new__(cls)
        sandbox.options, sandbox.killed, sandbox.runs = bound.arguments, False, 0
        cls.made.append(sandbox)
        return sandbox

    @property
    def sandbox_id(self):
        return f"fake-{self.made.index(self)}"

    async def run_code(self, code, **kwargs):
        inspect.signature(AsyncSandbox.run_code).bind(self, code, **kwargs)
        assert not self.killed, "a killed sandbox was used"
        self.runs += 1
        if self.KERNEL_DIES in code:
            return Execution(error=ExecutionError(name="KernelDied", value="oom", traceback=""))
        if self.RUNNER_HANGS in code:
            raise TimeoutException("Execution timed out")
        command = [PYTHON, "-c", code]
        out = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60)
        return Execution(logs=Logs(stdout=[out.stdout], stderr=[out.stderr]))

    async def kill(self, **opts):
        self.killed = True
        return True


@pytest.fixture
def fake_cloud(monkeypatch):
    monkeypatch.setattr(e2b_code_interpreter, "AsyncSandbox", FakeAsyncSandbox)
    FakeAsyncSandbox.made = []
    return FakeAsyncSandbox.made


@pytest.mark.process
def test_arun_on_a_fake_async_sandbox_pools_sandboxes_with_internet_off(fake_cloud):
    sandbox = E2BSandbox(api_key="test-key", pool_size=1, sandbox_uid=TEST_UID)

    async def run():
        results = [
            await sandbox.arun("print(input()[::-1])", stdin="abc"),
            await sandbox.arun("print(open('d.txt').read())", files={"d.txt": "hi"}),
            await sandbox.arun("import sys; sys.exit(3)"),
            await sandbox.arun(f"# {FakeAsyncSandbox.KERNEL_DIES}"),  # its sandbox is not reused
            await sandbox.arun(f"# {FakeAsyncSandbox.RUNNER_HANGS}"),  # nor this one
            await sandbox.arun("print(2)"),
        ]
        await sandbox.aclose()
        return results

    results = asyncio.run(run())
    assert [(r.status, r.stdout) for r in results] == [
        ("ok", "cba\n"),
        ("ok", "hi\n"),
        ("runtime_error", ""),
        ("sandbox_error", ""),
        ("timeout", ""),
        ("ok", "2\n"),
    ]
    assert [s.runs for s in fake_cloud] == [4, 1, 1]  # one sandbox for the first four runs
    assert all(s.killed for s in fake_cloud)  # aclose killed the idle one
    assert all(s.options["allow_internet_access"] is False for s in fake_cloud)
    assert fake_cloud[0].options["opts"] == {"api_key": "test-key"}
    assert sandbox.stats == {"created": 3, "reused": 3, "killed": 3}


@pytest.mark.process
def test_sync_runs_share_the_pool(fake_cloud):
    sandbox = E2BSandbox(api_key="test-key", sandbox_uid=TEST_UID)
    assert [sandbox.run(f"print({i})").stdout for i in range(3)] == ["0\n", "1\n", "2\n"]
    sandbox.close()
    assert len(fake_cloud) == 1 and fake_cloud[0].runs == 3 and fake_cloud[0].killed


@pytest.mark.process
def test_idle_sandboxes_of_a_finished_loop_are_killed_by_close(fake_cloud):
    sandbox = E2BSandbox(api_key="test-key", sandbox_uid=TEST_UID)
    assert asyncio.run(sandbox.arun("print(1)")).stdout == "1\n"  # its loop is closed; its sandbox idles
    assert not fake_cloud[0].killed
    sandbox.close()  # as at interpreter exit
    assert fake_cloud[0].killed and sandbox.stats["killed"] == 1


EXIT_SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("fake_e2b_tests", sys.argv[1])
tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tests)
import e2b_code_interpreter
class Loud(tests.FakeAsyncSandbox):
    async def kill(self, **opts):
        print("killed", self.sandbox_id, flush=True)
e2b_code_interpreter.AsyncSandbox = Loud
from areal_agents.sandbox.e2b import E2BSandbox
print(E2BSandbox(api_key="test-key", sandbox_uid=tests.TEST_UID).run("print(1)").stdout, end="", flush=True)
"""


@pytest.mark.process
def test_a_fake_sandbox_left_idle_is_killed_at_interpreter_exit():
    """``E2BSandbox().run(...)`` in a one-off script: its sandbox does not idle, billed, until e2b ends it."""
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, __file__], capture_output=True, text=True, timeout=120)
    assert out.stdout == "1\nkilled fake-0\n", out.stderr[-2000:]
