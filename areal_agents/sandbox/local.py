"""`LocalSandbox`: bubblewrap namespaces + rlimits + a wall-clock kill, as an unprivileged uid.

Each run gets: no network (all namespaces unshared), a read-only minimal root (/usr and the symlinks
that make it a system), a private size-limited /tmp (the only writable place), the code and ``files``
read-only in /sandbox (the working directory), its own PID namespace and session, uid/gid 65534 inside,
and ``--die-with-parent``. The bwrap process itself runs as a distinct unprivileged host uid per slot, so
RLIMIT_NPROC counts only this run's processes (root is exempt from it). Limits: address space
(``memory_mb``), CPU seconds, file size, processes, no core dumps; stdout/stderr are capped; on timeout
or output overflow the whole process group is killed (the PID namespace dies with its init).

Without bwrap, runs are refused unless ``unsafe=True`` (then only rlimits and the uid protect the host).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import resource
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from areal_agents.errors import ArealAgentsError
from areal_agents.sandbox.base import ExecResult, Status

SANDBOX_UID = 65534  # "nobody" inside the sandbox
_HOST_UID_BASE = 61000  # bwrap runs as 61000 + slot on the host
_slots = itertools.count()
PYTHON = "/usr/bin/python3"  # the system interpreter: /usr is bound read-only, nothing under /root is


class SandboxUnavailable(ArealAgentsError):
    """bubblewrap is missing and unsafe mode was not asked for."""


class LocalSandbox:
    """Run Python code in a bubblewrap sandbox on this machine (the default backend)."""

    def __init__(
        self,
        *,
        max_output_bytes: int = 1 << 20,
        max_processes: int = 64,
        max_file_mb: int = 64,
        tmp_mb: int = 64,
        unsafe: bool = False,
        python: str = PYTHON,
    ) -> None:
        self.max_output_bytes, self.max_processes = max_output_bytes, max_processes
        self.max_file_mb, self.tmp_mb, self.unsafe, self.python = max_file_mb, tmp_mb, unsafe, python
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None and not unsafe:
            raise SandboxUnavailable(
                "bubblewrap (bwrap) is not installed, so code cannot run isolated: install it "
                "(apt-get install -y bubblewrap, or bash scripts/setup.sh) or pass unsafe=True knowingly"
            )
        if not Path(python).is_file():
            raise SandboxUnavailable(f"interpreter {python} not found (the sandbox binds /usr only)")

    def _command(self, workdir: str) -> list[str]:
        if self.bwrap is None:  # unsafe mode
            return [self.python, "-I", "-S", "main.py"]
        return [
            self.bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--disable-userns",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--ro-bind-try", "/etc/alternatives", "/etc/alternatives",
            "--proc", "/proc", "--dev", "/dev",
            "--size", str(self.tmp_mb << 20), "--tmpfs", "/tmp",
            "--ro-bind", workdir, "/sandbox", "--remount-ro", "/", "--chdir", "/sandbox",
            "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            self.python, "-I", "-S", "main.py",
        ]  # fmt: skip

    def run(
        self,
        code: str,
        *,
        stdin: str | None = None,
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        files: dict[str, str] | None = None,
        language: str = "python",
    ) -> ExecResult:
        if language != "python":
            raise ValueError(f"LocalSandbox runs language 'python', got {language!r}")
        start = time.perf_counter()
        workdir = tempfile.mkdtemp(prefix="areal-sbx-")
        try:
            os.chmod(workdir, 0o755)
            for name, content in {**(files or {}), "main.py": code}.items():
                path = Path(workdir) / name
                if path.resolve().parent != Path(workdir).resolve():
                    raise ValueError(f"files: {name!r} must be a plain file name")
                path.write_text(content)
                path.chmod(0o644)
            return self._execute(workdir, stdin, timeout_s, memory_mb, start)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def arun(self, code: str, **kwargs) -> ExecResult:  # noqa: ANN003  (same keywords as run)
        return await asyncio.to_thread(self.run, code, **kwargs)

    def _execute(self, workdir: str, stdin: str | None, timeout_s: float, memory_mb: int, start: float) -> ExecResult:
        uid = _HOST_UID_BASE + next(_slots) % 1000 if os.getuid() == 0 else None
        limits = [
            (resource.RLIMIT_AS, (memory_mb + 64) << 20),  # + room for bwrap and the interpreter itself
            (resource.RLIMIT_CPU, int(timeout_s) + 1),
            (resource.RLIMIT_FSIZE, self.max_file_mb << 20),
            (resource.RLIMIT_NPROC, self.max_processes),
            (resource.RLIMIT_CORE, 0),
        ]

        def preexec() -> None:  # runs in the child between fork and exec
            for which, value in limits:
                resource.setrlimit(which, (value, value))

        try:
            proc = subprocess.Popen(
                self._command(workdir),
                cwd=workdir,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=preexec,
                user=uid,
                group=uid,
                extra_groups=[] if uid is not None else None,
            )
        except OSError as e:
            return ExecResult("", f"sandbox failed to start: {e}", None, "sandbox_error", time.perf_counter() - start)
        out, err, overflow, timed_out = self._communicate(proc, (stdin or "").encode(), start + timeout_s)
        code = proc.returncode
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        status = _status(code, stderr, overflow, timed_out, sandbox=self.bwrap is not None)
        return ExecResult(stdout, stderr, code, status, time.perf_counter() - start)

    def _communicate(self, proc: subprocess.Popen, data: bytes, deadline: float) -> tuple[bytes, bytes, bool, bool]:
        """Feed stdin, read both pipes up to the cap, kill the group on overflow or deadline."""
        buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        overflow = timed_out = False
        try:
            proc.stdin.write(data)
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        with selectors.DefaultSelector() as sel:
            for pipe in buffers:
                sel.register(pipe, selectors.EVENT_READ)
            while sel.get_map():
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(timeout=min(remaining, 0.5)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buffers[key.fileobj] += chunk
                    if sum(len(b) for b in buffers.values()) > self.max_output_bytes:
                        overflow = True
                if overflow:
                    break
        if timed_out or overflow:
            _kill_group(proc)
        try:
            proc.wait(timeout=max(deadline - time.perf_counter(), 0) + 5)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            proc.wait()
        for pipe in buffers:
            pipe.close()
        cap = self.max_output_bytes
        return bytes(buffers[proc.stdout][:cap]), bytes(buffers[proc.stderr][:cap]), overflow, timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _status(code: int | None, stderr: str, overflow: bool, timed_out: bool, sandbox: bool) -> Status:
    if overflow:
        return "output_limit"
    if timed_out or code == -signal.SIGXCPU:
        return "timeout"
    if code == 0:
        return "ok"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory_limit"
    if sandbox and code is not None and code != 0 and stderr.startswith("bwrap:"):
        return "sandbox_error"
    if code is not None and code < 0:
        return "killed"
    return "runtime_error"
