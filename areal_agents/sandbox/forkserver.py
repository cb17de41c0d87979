"""The warm interpreter inside one bwrap sandbox: clones a fresh, capability-less program per run.

Runs under the system python as ``python3 -I -S forkserver.py FD`` inside bwrap (stdlib only, never imported
by the package). At start it takes a private mount namespace and drops the capability bounding set. Per
request it gives the program a private, empty, size-limited /tmp and /dev/shm, a read-only /sandbox holding just the
request's files, stdin from a memfd, and stdout/stderr into memfds sealed at the output cap. The program is
cloned into new PID and IPC namespaces as their PID 1. The program sets its rlimits, drops every
capability (locked securebits, no_new_privs) and runs ``main.py`` as ``python main.py`` would; when it exits
the kernel kills whatever it left in its PID namespace. This server enforces the wall-clock limit.

Wire: 4-byte big-endian length + JSON, both ways. A request has files, stdin, limits; the reply has the exit
code, stdout and stderr (capped), and whether the time or output limit was hit.
"""

import atexit
import ctypes
import fcntl
import gc
import json
import os
import resource
import select
import signal
import socket
import struct
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID = 0x00020000, 0x04000000, 0x08000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 4, 24, 28, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECURE_ALL_BITS_LOCKED = 0x3F  # noroot, no_setuid_fixup, keep_caps off: each with its lock bit
CAP_LAST = 63
SYS_CAPSET, SYS_CLONE = (126, 56) if os.uname().machine == "x86_64" else (91, 220)  # else aarch64
MNT_DETACH = 2
LIBC = ctypes.CDLL(None, use_errno=True)
PYLIBC = ctypes.PyDLL(None, use_errno=True)  # keeps the GIL across clone()
HEADER = struct.Struct(">I")


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _drop_bounding_set() -> None:
    """Nothing exec'd below this server can gain a capability; the server keeps its own until it forks."""
    for cap in range(CAP_LAST + 1):
        if LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: no such cap
            _check(-1, f"drop capability {cap}")


def _drop_capabilities() -> None:
    """After this the program is an ordinary unprivileged process (the bounding set is already empty)."""
    _check(LIBC.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    _check(LIBC.prctl(PR_SET_SECUREBITS, SECURE_ALL_BITS_LOCKED, 0, 0, 0), "lock securebits")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (x2 words): all empty
    _check(LIBC.syscall(SYS_CAPSET, header, data), "capset")
    _check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _fresh_tmpfs(path: str, size: int, mode: str) -> None:
    """Replace the tmpfs at ``path`` (ours, mounted over bwrap's) with an empty one."""
    _check(LIBC.umount2(path.encode(), MNT_DETACH), f"umount {path}")
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={mode}")


def _clone_into_new_pid_namespace() -> int:
    """fork(), with the child as PID 1 of new PID and IPC namespaces (os.fork has no flags)."""
    pid = PYLIBC.syscall(SYS_CLONE, ctypes.c_ulong(CLONE_NEWPID | CLONE_NEWIPC | signal.SIGCHLD), 0, 0, 0, 0)
    if pid < 0:
        _check(-1, "clone")
    return pid


def _run_program(rlimits: dict[str, list[int]], stdio: list[int]) -> None:
    """PID 1 of the run's namespaces: take stdio and limits, drop privileges, run main.py like python does."""
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
    os.closerange(3, 1 << 16)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # python's own default is to ignore it
    os.setsid()
    os.chdir("/sandbox")
    for name, soft_hard in rlimits.items():  # (soft, hard), as LocalSandbox._rlimits gives them
        resource.setrlimit(getattr(resource, name), tuple(soft_hard))
    _drop_capabilities()
    # sys.stdin/stdout/stderr wrap fds 0-2, now the run's: their buffers are empty, the server never uses them
    sys.argv = ["main.py"]
    sys.path[0:0] = ["/sandbox"]
    gc.enable()  # the program gets a normal interpreter
    code = 0
    try:
        source = open("/sandbox/main.py").read()
        exec(compile(source, "/sandbox/main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else (print(e.code, file=sys.stderr) or 1))
    except BaseException:  # noqa: BLE001  (what the interpreter itself would print)
        __import__("traceback").print_exc()  # imported here: a smaller server forks faster
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass
    os._exit(code & 0xFF)


def _execute(req: dict) -> dict:
    """Run one request in a fresh program; reply with how it ended."""
    cap = req["max_output_bytes"]
    _prepare_files(req)
    stdio = [_memfd("stdin", req["stdin"].encode(), size=None)]
    try:
        stdio += [_memfd(name, b"", size=cap + 1) for name in ("stdout", "stderr")]
        pid = _clone_into_new_pid_namespace()
        if pid == 0:
            try:
                _run_program(req["rlimits"], stdio)
            finally:
                os._exit(125)
    except BaseException:
        for fd in stdio:
            os.close(fd)
        raise
    os.close(stdio[0])
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd], [], [], req["timeout_s"])
    os.close(pidfd)
    if not ready:
        os.kill(pid, signal.SIGKILL)  # PID 1 of the run: the kernel kills the rest of its namespace
    _, status = os.waitpid(pid, 0)
    stdout, stderr = (_written(fd, cap + 1) for fd in stdio[1:])
    return {
        "exit_code": os.waitstatus_to_exitcode(status),
        "timed_out": not ready,
        "output_limit": len(stdout) + len(stderr) > cap,
        "stdout": stdout[:cap].decode(errors="replace"),
        "stderr": stderr[:cap].decode(errors="replace"),
    }


def _memfd(name: str, data: bytes, size: int | None) -> int:
    """An in-memory file; with ``size``, sealed at that size so writes past it fail (the output cap)."""
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    if size is not None:
        os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    return fd


def _written(fd: int, size: int) -> bytes:
    """What the program wrote to a sealed output memfd: it shares our file offset."""
    try:
        return os.pread(fd, min(os.lseek(fd, 0, os.SEEK_CUR), size), 0)
    finally:
        os.close(fd)


SCRATCH = ("/tmp", "/dev/shm")  # the only writable places: private to each run
_workspace: dict = {"files": [], "scratch": {}}


def _prepare_files(req: dict) -> None:
    """/sandbox holds just this request's files, read-only; /tmp and /dev/shm are empty and private to this run.

    All are tmpfs mounts of ours. /sandbox is remounted writable only while we swap the files. A scratch
    dir is replaced by a fresh mount unless the last run left it untouched (same mtime, ctime, mode and
    owner, no entries): a new mount costs more kernel time than the rest of a run's setup.
    """
    _mount(None, "/sandbox", None, MS_REMOUNT | MS_NOSUID | MS_NODEV)
    for name in _workspace["files"]:
        os.unlink(os.path.join("/sandbox", name))
    _workspace["files"] = []
    for name, content in req["files"].items():
        with open(os.path.join("/sandbox", name), "w") as f:
            _workspace["files"].append(name)
            f.write(content)
    _mount(None, "/sandbox", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    for path in SCRATCH:
        stamp = (req["tmp_bytes"], *_stamp(path))
        if _workspace["scratch"].get(path) != stamp or os.listdir(path):
            _fresh_tmpfs(path, req["tmp_bytes"], "1777")
            _workspace["scratch"][path] = (req["tmp_bytes"], *_stamp(path))


def _stamp(path: str) -> tuple[int, ...]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid, st.st_gid


def _remount_readonly(path: str) -> None:
    """Make a mount bwrap made (e.g. /dev) read-only here, keeping its locked flags."""
    flags = os.statvfs(path).f_flag
    keep = [(os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, 8), (os.ST_NOATIME, 1024),
            (os.ST_NODIRATIME, 2048), (os.ST_RELATIME, 1 << 21)]  # fmt: skip
    extra = sum(ms for st, ms in keep if flags & st)
    _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # runs cannot read or ptrace this process through /proc
    _check(LIBC.unshare(CLONE_NEWNS), "unshare")  # a mount namespace of our own: bwrap's mounts are locked
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _remount_readonly("/dev")  # bwrap's /dev (and /dev/shm on it) would otherwise outlive a run
    for path in SCRATCH:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=4096,mode=1777")
    _mount("tmpfs", "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=755")
    _drop_bounding_set()
    for name in ("prctl", "syscall", "umount2", "mount"):  # resolve once here, not in every forked child
        getattr(LIBC, name), getattr(PYLIBC, name)
    gc.disable()  # this loop makes no cycles; a frozen heap also spares each child copy-on-write faults
    gc.freeze()
    sock.sendall(HEADER.pack(2) + b"{}")  # ready
    devnull = os.open("/dev/null", os.O_WRONLY)
    os.dup2(devnull, 2)  # the host reads our stderr only for start-up errors
    os.close(devnull)
    while True:
        try:
            req = json.loads(_recv_exact(sock, HEADER.unpack(_recv_exact(sock, HEADER.size))[0]))
        except EOFError:
            return
        try:
            reply = _execute(req)
        except Exception as e:  # noqa: BLE001  (reported to the host, which replaces this server)
            reply = {"error": f"{type(e).__name__}: {e}"}
        del req
        body = json.dumps(reply).encode()
        sock.sendall(HEADER.pack(len(body)) + body)


if __name__ == "__main__":
    main()
