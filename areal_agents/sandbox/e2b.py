"""`E2BSandbox`: the same `Sandbox` API on e2b cloud sandboxes (``pip install 'areal-agents[e2b]'``).

Needs ``E2B_API_KEY`` (and ``E2B_DOMAIN`` for a self-hosted e2b). Cloud sandboxes are created with
internet access off (``allow_internet_access=False`` unless asked for) and kept in a pool: a run takes an
idle one (or creates one), executes a small runner with ``AsyncSandbox.run_code`` and gives it back, so
a sandbox's start-up is paid once per ``max_runs_per_sandbox`` runs, not per run. A sandbox whose run
went wrong (no record, the runner itself hung) is killed instead; idle ones past ``pool_size`` are
killed, the idle ones left are killed at interpreter exit (or now by ``close``/``aclose``), and e2b
kills any sandbox at the end of its ``lifetime_s`` (a process killed hard leaves them that long).

The runner writes the files into a fresh directory and runs the program in its own session with the
stdin, a wall-clock timeout and limits on address space, CPU seconds, file size (``max_file_mb``, which
also bounds what it can print) and processes (``max_processes``); where the runner is root it runs the
program as an unprivileged uid (``sandbox_uid``) that cannot touch the pooled sandbox, and afterwards
kills every process of that uid. It prints one JSON record, so statuses mean exactly what they mean for
`LocalSandbox`. The cloud is unreachable from this project's machines: the tests run the runner for
real, locally, behind a stand-in ``AsyncSandbox`` built from the SDK's own types.

    sandbox = E2BSandbox()
    result = sandbox.run("print(1)")        # ExecResult(stdout="1\\n", status="ok", ...)
    sandbox.close()                         # kill the idle sandboxes now
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from areal_agents.sandbox.base import ExecResult
from areal_agents.sandbox.local import SandboxUnavailable, _status

RECORD = "__AREAL_E2B_RECORD__"

_RUNNER = """
import json, os, resource, shutil, subprocess, sys, tempfile
_spec = json.loads({spec!r})
_root = os.getuid() == 0
_uid = _spec["uid"] if _root else os.getuid()
_dir, _io = tempfile.mkdtemp(), tempfile.mkdtemp()
_tmp = os.path.join(_dir, "tmp")
os.mkdir(_tmp)
os.chmod(_dir, 0o755)
if _root:
    os.chown(_tmp, _uid, _uid)
for _name, _content in _spec["files"].items():
    with open(os.path.join(_dir, _name), "w") as _f:
        _f.write(_content)
with open(os.path.join(_io, "stdin"), "w") as _f:
    _f.write(_spec["stdin"])
def _tasks(uid):
    _n = 0
    for _pid in os.listdir("/proc"):
        try:
            if _pid.isdigit() and os.stat("/proc/" + _pid).st_uid == uid:
                _n += len(os.listdir("/proc/" + _pid + "/task"))
        except OSError:
            pass
    return _n
_nproc = _tasks(_uid) + _spec["max_processes"]
def _drop():
    os.setgroups([])
    os.setgid(_uid)
    os.setuid(_uid)
def _limits():
    for _r, _v in ((resource.RLIMIT_AS, _spec["memory_mb"] << 20), (resource.RLIMIT_CPU, _spec["cpu_s"]),
                   (resource.RLIMIT_FSIZE, _spec["file_mb"] << 20), (resource.RLIMIT_NPROC, _nproc),
                   (resource.RLIMIT_CORE, 0)):
        _hard = resource.getrlimit(_r)[1]
        _v = _v if _hard == resource.RLIM_INFINITY else min(_v, _hard)
        resource.setrlimit(_r, (_v, _v))
    if _root:
        _drop()
_env = {{"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": _tmp, "TMPDIR": _tmp, "LANG": "C.UTF-8"}}
_out, _err = os.path.join(_io, "stdout"), os.path.join(_io, "stderr")
with open(os.path.join(_io, "stdin")) as _i, open(_out, "wb") as _o, open(_err, "wb") as _e:
    _p = subprocess.Popen([sys.executable, "main.py"], cwd=_dir, stdin=_i, stdout=_o, stderr=_e, env=_env,
                          preexec_fn=_limits, start_new_session=True)
    try:
        _code, _timed_out = _p.wait(timeout=_spec["timeout_s"]), False
    except subprocess.TimeoutExpired:
        _code, _timed_out = -9, True
try:
    os.killpg(_p.pid, 9)
except OSError:
    pass
_p.wait()
if _root:  # whatever it left running, in any session
    subprocess.run([sys.executable, "-c", "import os; os.kill(-1, 9)"], preexec_fn=_drop, env=_env)
def _read(path):
    with open(path, "rb") as _f:
        return _f.read(_spec["cap"]).decode(errors="replace"), os.path.getsize(path)
(_stdout, _n_out), (_stderr, _n_err) = _read(_out), _read(_err)
shutil.rmtree(_dir, ignore_errors=True)
shutil.rmtree(_io, ignore_errors=True)
_rec = {{"stdout": _stdout, "stderr": _stderr, "exit_code": _code, "overflow": _n_out + _n_err > _spec["cap"],
        "timed_out": _timed_out}}
print({record!r} + json.dumps(_rec))
"""


def runner_source(
    code: str,
    stdin: str | None,
    timeout_s: float,
    memory_mb: int,
    files: dict[str, str] | None,
    cap: int,
    *,
    max_processes: int = 64,
    max_file_mb: int = 64,
    uid: int = 65534,
) -> str:
    """The program `run_code` executes in the e2b sandbox for one `run`."""
    spec = {
        "files": {**(files or {}), "main.py": code},
        "stdin": stdin or "",
        "timeout_s": timeout_s,
        "memory_mb": memory_mb + 64,
        "cpu_s": int(timeout_s) + 1,
        "file_mb": max_file_mb,
        "max_processes": max_processes,
        "uid": uid,
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


@dataclass
class _Pooled:
    sandbox: Any  # an e2b_code_interpreter.AsyncSandbox
    expires: float  # time.monotonic() at which e2b kills it
    runs: int = 0


class _Idle:
    """The idle sandboxes, per event loop (an SDK client is bound to its loop), and `run`'s own loop in a
    daemon thread. Apart from `E2BSandbox`, so the exit hook can kill what an instance left behind."""

    def __init__(self, stats: collections.Counter[str]) -> None:
        self.by_loop: dict[asyncio.AbstractEventLoop, list[_Pooled]] = {}
        self.stats = stats
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lock = threading.Lock()
        self.exit_hook = False

    def here(self) -> list[_Pooled]:
        return self.by_loop.setdefault(asyncio.get_running_loop(), [])

    async def kill(self, pooled: _Pooled) -> None:
        self.stats["killed"] += 1
        try:
            await pooled.sandbox.kill()
        except Exception:
            pass  # already gone; e2b ends it at its lifetime anyway

    def kill_all(self) -> None:
        """Kill every idle sandbox, of any loop, from the background loop (at most 30 s)."""
        idle = [p for loop in list(self.by_loop) for p in self.by_loop.pop(loop, [])]
        if idle:

            async def kill_all() -> None:
                await asyncio.gather(*(self.kill(p) for p in idle))

            try:
                asyncio.run_coroutine_threadsafe(kill_all(), self.background_loop()).result(timeout=30)
            except Exception:
                pass  # best effort: e2b ends them at their lifetime anyway

    def background_loop(self) -> asyncio.AbstractEventLoop:
        with self.lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self.loop.run_forever, name="e2b-sandbox", daemon=True).start()
            return self.loop


class E2BSandbox:
    """Runs executions in pooled e2b sandboxes, internet off; counters in ``stats`` (created, reused, killed)."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        domain: str | None = None,
        template: str | None = None,
        max_output_bytes: int = 1 << 20,
        allow_internet_access: bool = False,
        pool_size: int = 4,
        max_runs_per_sandbox: int = 256,
        lifetime_s: int = 300,
        max_processes: int = 64,
        max_file_mb: int = 64,
        sandbox_uid: int = 65534,
    ) -> None:
        """``pool_size``: idle sandboxes kept per event loop; ``lifetime_s``: e2b's timeout for each (a run
        needs ``timeout_s + 60`` s of it left, else a fresh one is made); ``sandbox_uid``: the uid programs
        run as where the runner is root (its processes are killed after every run)."""
        try:
            import e2b_code_interpreter  # noqa: F401
        except ImportError:
            raise SandboxUnavailable("the e2b backend needs its SDK: pip install 'areal-agents[e2b]'") from None
        self.api_key = api_key or os.environ.get("E2B_API_KEY")
        if not self.api_key:
            raise SandboxUnavailable("the e2b backend needs an API key: set E2B_API_KEY (or pass api_key=)")
        if pool_size < 0 or max_runs_per_sandbox < 1 or lifetime_s < 1:
            raise ValueError(
                f"Expects pool_size >= 0, max_runs_per_sandbox >= 1 and lifetime_s >= 1, got {pool_size}, "
                f"{max_runs_per_sandbox} and {lifetime_s}"
            )
        self.domain = domain or os.environ.get("E2B_DOMAIN")
        self.template, self.max_output_bytes = template, max_output_bytes
        self.allow_internet_access, self.pool_size = allow_internet_access, pool_size
        self.max_runs_per_sandbox, self.lifetime_s = max_runs_per_sandbox, lifetime_s
        self.limits = {"max_processes": max_processes, "max_file_mb": max_file_mb, "uid": sandbox_uid}
        self.stats: collections.Counter[str] = collections.Counter()
        self._idle = _Idle(self.stats)

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
        from e2b_code_interpreter import TimeoutException

        if language != "python":
            raise ValueError(f"E2BSandbox runs language 'python', got {language!r}")
        start = time.perf_counter()
        try:
            pooled = await self._acquire(timeout_s)
        except Exception as e:
            return ExecResult(
                "", f"e2b: cannot create a sandbox: {e}", None, "sandbox_error", time.perf_counter() - start
            )
        reusable = False
        try:
            source = runner_source(code, stdin, timeout_s, memory_mb, files, self.max_output_bytes, **self.limits)
            execution = await pooled.sandbox.run_code(source, timeout=timeout_s + 30)
            result = execution_to_result(execution, time.perf_counter() - start)
            reusable = result.status != "sandbox_error"
            return result
        except TimeoutException:  # the runner itself hung: this sandbox is not reused
            return ExecResult("", "", None, "timeout", time.perf_counter() - start)
        except Exception as e:
            return ExecResult("", f"e2b: {type(e).__name__}: {e}", None, "sandbox_error", time.perf_counter() - start)
        finally:
            await self._release(pooled, reusable)

    def run(self, code: str, **kwargs: Any) -> ExecResult:
        """The blocking form of `arun` (from any thread, even one running an event loop); sync runs share
        one background loop, so they share its pool."""
        loop = self._idle.background_loop()
        return asyncio.run_coroutine_threadsafe(self.arun(code, **kwargs), loop).result()

    async def aclose(self) -> None:
        """Kill the idle sandboxes of the running loop (`close` kills those of every loop)."""
        idle = self._idle.by_loop.pop(asyncio.get_running_loop(), [])
        await asyncio.gather(*(self._idle.kill(p) for p in idle))

    def close(self) -> None:
        """Kill every idle sandbox, of any event loop (done at interpreter exit too)."""
        self._idle.kill_all()

    async def _acquire(self, timeout_s: float) -> _Pooled:
        from e2b_code_interpreter import AsyncSandbox

        idle = self._idle.here()
        while idle:
            pooled = idle.pop()
            if pooled.expires - time.monotonic() > timeout_s + 60:
                self.stats["reused"] += 1
                return pooled
            await self._idle.kill(pooled)  # too little of its lifetime left for this run
        lifetime = max(self.lifetime_s, int(timeout_s) + 90)
        options: dict[str, Any] = {"api_key": self.api_key}
        if self.domain:
            options["domain"] = self.domain
        created = time.monotonic()
        sandbox = await AsyncSandbox.create(
            template=self.template, timeout=lifetime, allow_internet_access=self.allow_internet_access, **options
        )
        self.stats["created"] += 1
        if not self._idle.exit_hook:  # idle sandboxes cost money until e2b ends them
            self._idle.exit_hook = True
            atexit.register(self._idle.kill_all)
        return _Pooled(sandbox, created + lifetime)

    async def _release(self, pooled: _Pooled, reusable: bool) -> None:
        pooled.runs += 1
        idle = self._idle.here()
        if reusable and pooled.runs < self.max_runs_per_sandbox and len(idle) < self.pool_size:
            idle.append(pooled)
        else:
            await self._idle.kill(pooled)
