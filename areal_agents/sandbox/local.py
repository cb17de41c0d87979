"""`LocalSandbox`: bubblewrap namespaces + rlimits + a wall-clock kill, as an unprivileged uid, from a warm fork server.

Isolation of every run: no network (all namespaces unshared), a read-only minimal root (/usr and the
symlinks that make it a system), a private size-limited /tmp (the only writable place), the code and
``files`` read-only in /sandbox (the working directory), its own PID, mount, IPC and UTS namespaces and
session, no capabilities (bounding set empty, securebits locked, no_new_privs), an unprivileged uid, and
death with the parent. Each sandbox slot runs as a distinct unprivileged host uid, so RLIMIT_NPROC counts
only that slot's processes (root is exempt from it). Limits: address space (``memory_mb``), CPU seconds,
file size, processes, no core dumps; stdout/stderr are capped; on timeout the run's PID namespace is
killed, on output overflow its whole slot.

Speed: by default a slot is a warm interpreter inside one bwrap sandbox (`forkserver.py`) that forks a fresh
namespaced child per run instead of starting bwrap and python each time (see ``bench/sandbox.py``);
``warm=False`` spawns bwrap + python per run. Without bwrap, runs are refused unless ``unsafe=True`` (then
only rlimits and the uid protect the host).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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
        warm: bool = True,
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
        self.warm = warm and self.bwrap is not None  # the fork servers are per process: see _fork_servers

    def _command(self, workdir: str) -> list[str]:
        if self.bwrap is None:  # unsafe mode
            return [self.python, "-I", "-S", "main.py"]
        return [
            *_bwrap_isolation(self.bwrap, self.tmp_mb),
            "--ro-bind", workdir, "/sandbox", "--remount-ro", "/", "--chdir", "/sandbox",
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
        files = {**(files or {}), "main.py": code}
        for name in files:
            if not name or "/" in name or name in (".", ".."):
                raise ValueError(f"files: {name!r} must be a plain file name")
        if self.warm:
            return self._execute_warm(files, stdin or "", timeout_s, memory_mb, start)
        workdir = tempfile.mkdtemp(prefix="areal-sbx-")
        try:
            os.chmod(workdir, 0o755)
            for name, content in files.items():
                path = Path(workdir) / name
                path.write_text(content)
                path.chmod(0o644)
            return self._execute(workdir, stdin, timeout_s, memory_mb, start)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def arun(self, code: str, **kwargs) -> ExecResult:  # noqa: ANN003  (same keywords as run)
        return await asyncio.to_thread(self.run, code, **kwargs)

    def _rlimits(self, timeout_s: float, memory_mb: int, extra_processes: int = 0) -> dict[str, tuple[int, int]]:
        """(soft, hard) limits of a run. CPU: SIGXCPU (a timeout verdict) a second before the hard SIGKILL;
        with both equal the kernel sends SIGKILL, and a loop whose wall-clock kill came late read as killed."""
        cpu = int(timeout_s) + 1
        limits = {
            "RLIMIT_AS": (memory_mb + 64) << 20,  # + room for the interpreter itself
            "RLIMIT_FSIZE": self.max_file_mb << 20,
            "RLIMIT_NPROC": self.max_processes + extra_processes,
            "RLIMIT_CORE": 0,
        }
        return {**{k: (v, v) for k, v in limits.items()}, "RLIMIT_CPU": (cpu, cpu + 1)}

    def _execute_warm(
        self, files: dict[str, str], stdin: str, timeout_s: float, memory_mb: int, start: float
    ) -> ExecResult:
        request = {
            "files": files,
            "stdin": stdin,
            "timeout_s": timeout_s,
            "tmp_bytes": self.tmp_mb << 20,
            "max_output_bytes": self.max_output_bytes,
            "rlimits": self._rlimits(timeout_s, memory_mb, extra_processes=1),  # + the fork server
        }
        pool = _fork_servers(self.bwrap, self.python)
        try:
            server = pool.acquire()
        except OSError as e:
            return ExecResult("", f"sandbox failed to start: {e}", None, "sandbox_error", time.perf_counter() - start)
        reply, late = server.call(request, deadline=start + timeout_s + _GRACE_S)
        pool.release(server, healthy=reply is not None and "error" not in reply)  # else it is replaced
        wall_s = time.perf_counter() - start
        if late:  # the server did not enforce the limit itself: it was killed with its slot
            return ExecResult("", "", None, "timeout", wall_s)
        if reply is None or "error" in reply:
            why = "the fork server died" if reply is None else reply["error"]
            return ExecResult("", f"sandbox error: {why}", None, "sandbox_error", wall_s)
        code, stderr = reply["exit_code"], reply["stderr"]
        status = _status(code, stderr, reply["output_limit"], reply["timed_out"], sandbox=False)
        return ExecResult(reply["stdout"], stderr, code, status, wall_s)

    def _execute(self, workdir: str, stdin: str | None, timeout_s: float, memory_mb: int, start: float) -> ExecResult:
        uid = _HOST_UID_BASE + next(_slots) % 1000 if os.getuid() == 0 else None
        limits = [(getattr(resource, k), v) for k, v in self._rlimits(timeout_s, memory_mb).items()]

        def preexec() -> None:  # runs in the child between fork and exec
            for which, soft_hard in limits:
                resource.setrlimit(which, soft_hard)

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
        try:
            proc.stdin.write((stdin or "").encode())  # a program that never reads a big stdin only loses it
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        pipes = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        overflow, timed_out = _drain(pipes, self.max_output_bytes, start + timeout_s)
        if timed_out or overflow:
            _kill_group(proc.pid)
        try:
            proc.wait(timeout=max(start + timeout_s - time.perf_counter(), 0) + 5)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        stdout, stderr = (bytes(b[: self.max_output_bytes]).decode(errors="replace") for b in pipes.values())
        status = _status(proc.returncode, stderr, overflow, timed_out, sandbox=self.bwrap is not None)
        return ExecResult(stdout, stderr, proc.returncode, status, time.perf_counter() - start)


_GRACE_S = 2.0  # the fork server enforces the time limit; the host steps in only if it does not
_FORKSERVER = Path(__file__).with_name("forkserver.py")


def _bwrap_isolation(bwrap: str, tmp_mb: int) -> list[str]:
    """The bwrap flags every sandbox shares: all namespaces, read-only /usr, private /tmp, a clean env."""
    return [
        bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--disable-userns",
        "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64", "--ro-bind-try", "/etc/alternatives", "/etc/alternatives",
        "--proc", "/proc", "--dev", "/dev", "--size", str(tmp_mb << 20), "--tmpfs", "/tmp",
        "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
    ]  # fmt: skip


class _ForkServer:
    """One warm slot: `forkserver.py` in its own bwrap sandbox and host uid, spoken to over a socketpair."""

    def __init__(self, bwrap: str, python: str, uid: int | None) -> None:
        host_end, server_end = socket.socketpair()
        command = [
            *_bwrap_isolation(bwrap, 1),
            "--dir", "/sandbox", "--ro-bind", str(_FORKSERVER), "/opt/forkserver.py", "--remount-ro", "/",
            "--chdir", "/", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--cap-add", "ALL",
            python, "-I", "-S", "/opt/forkserver.py", str(server_end.fileno()),
        ]  # fmt: skip
        try:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=[server_end.fileno()],
                start_new_session=True,
                user=uid,
                group=uid,
                extra_groups=[] if uid is not None else None,
            )
        finally:
            server_end.close()
        self.sock = host_end
        if self.receive(time.perf_counter() + 30)[0] != {}:
            _kill_group(self.proc.pid)
            why = self.proc.stderr.read().decode(errors="replace").strip()
            self.close()
            raise OSError(f"sandbox fork server did not start: {why}")

    def call(self, request: dict, deadline: float) -> tuple[dict | None, bool]:
        """(the reply, False); (None, True) past the deadline; (None, False) if the server died."""
        body = json.dumps(request).encode()
        try:
            self.sock.sendall(_HEADER.pack(len(body)) + body)
        except OSError:
            return None, False
        return self.receive(deadline)

    def receive(self, deadline: float) -> tuple[dict | None, bool]:
        try:
            self.sock.settimeout(max(deadline - time.perf_counter(), 0.001))
            size = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size))[0]
            return json.loads(_recv_exact(self.sock, size)), False
        except TimeoutError:
            return None, True
        except (OSError, EOFError, ValueError):
            return None, False

    def close(self) -> None:
        _kill_group(self.proc.pid)
        self.proc.wait()
        self.proc.stderr.close()
        self.sock.close()


class _ForkServerPool:
    """Idle fork servers shared by every LocalSandbox of a process; a slot that misbehaved is replaced."""

    def __init__(self, bwrap: str, python: str) -> None:
        self.bwrap, self.python = bwrap, python
        self.idle: list[_ForkServer] = []
        self.lock = threading.Lock()
        # bwrap --die-with-parent follows the *thread* that started it, so one long-lived thread starts them all
        self.starter = ThreadPoolExecutor(1, thread_name_prefix="sandbox-fork-servers")
        atexit.register(self.close)

    def acquire(self) -> _ForkServer:
        with self.lock:
            while self.idle:
                server = self.idle.pop()
                if server.proc.poll() is None:
                    return server
                server.close()
        uid = _HOST_UID_BASE + next(_slots) % 1000 if os.getuid() == 0 else None
        return self.starter.submit(_ForkServer, self.bwrap, self.python, uid).result()

    def release(self, server: _ForkServer, healthy: bool) -> None:
        if not healthy:
            server.close()
            return
        with self.lock:
            self.idle.append(server)

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for server in idle:
            server.close()


_pools: dict[tuple[int, str, str], _ForkServerPool] = {}
_pools_lock = threading.Lock()
_HEADER = struct.Struct(">I")


def _fork_servers(bwrap: str, python: str) -> _ForkServerPool:
    """This process's pool (a forked child must not share its parent's servers)."""
    key = (os.getpid(), bwrap, python)
    with _pools_lock:
        if key not in _pools:
            _pools[key] = _ForkServerPool(bwrap, python)
        return _pools[key]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("fork server closed the connection")
        data += chunk
    return data


def _drain(pipes: dict[int, bytearray], cap: int, deadline: float) -> tuple[bool, bool]:
    """Read the pipes to EOF into their buffers; stop early on more than ``cap`` bytes or at the deadline."""
    with selectors.DefaultSelector() as sel:
        for fd in pipes:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return False, True
            for key, _ in sel.select(timeout=min(remaining, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                pipes[key.fd] += chunk
                if sum(len(b) for b in pipes.values()) > cap:
                    return True, False
    return False, False


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
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
