"""The local sandbox against a hostile-code battery: each attack contained, with the right status."""

import os
import shutil
import subprocess
import time

import pytest

from areal_agents.sandbox import LocalSandbox, SandboxUnavailable
from areal_agents.sandbox.local import _HOST_UID_BASE

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
]


@pytest.fixture(scope="module", params=[True, False], ids=["warm", "cold"])
def sandbox(request):
    """Every attack runs against the warm fork server (the default) and a fresh bwrap per run."""
    return LocalSandbox(max_output_bytes=1 << 20, warm=request.param)


def leftover_sandbox_processes() -> list[str]:
    """Live processes of the sandbox host uids other than the warm fork servers (bwrap and its python child)."""
    out = subprocess.run(["ps", "-eo", "uid=,pid=,ppid=,stat=,comm=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 5) for line in out.splitlines()]
    ours = [r for r in rows if _HOST_UID_BASE <= int(r[0]) < _HOST_UID_BASE + 1000 and not r[3].startswith("Z")]
    bwraps = {r[1] for r in ours if r[4] == "bwrap"}
    return [" ".join(r) for r in ours if r[4] != "bwrap" and not (r[2] in bwraps and "forkserver.py" in r[5])]


def test_ok_with_stdin_and_files(sandbox):
    r = sandbox.run("print(open('data.txt').read() + input())", stdin="!", files={"data.txt": "hi"})
    assert (r.status, r.stdout, r.exit_code) == ("ok", "hi!\n", 0)


def test_runtime_error(sandbox):
    r = sandbox.run("raise ValueError('boom')")
    assert r.status == "runtime_error" and "ValueError: boom" in r.stderr


def test_fork_bomb(sandbox):
    r = sandbox.run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout_s=2
    )
    assert r.status == "timeout"
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def test_memory_bomb(sandbox):
    r = sandbox.run("x = bytearray(4 * 1024**3)", memory_mb=256)
    assert r.status == "memory_limit"


def test_infinite_loop_and_sleep(sandbox):
    for code in ("while True: pass", "import time; time.sleep(60)"):
        r = sandbox.run(code, timeout_s=1)
        assert r.status == "timeout" and r.wall_s < 3


def test_one_gigabyte_stdout_flood(sandbox):
    r = sandbox.run("import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)", timeout_s=10)
    assert r.status == "output_limit" and len(r.stdout) <= 1 << 20


def test_disk_fill_hits_the_private_tmp_limit(sandbox):
    r = sandbox.run("f = open('/tmp/fill', 'wb')\nwhile True:\n    f.write(b'0' * (1 << 20))", timeout_s=10)
    assert r.status == "runtime_error" and ("No space left" in r.stderr or "File too large" in r.stderr)


def test_no_network(sandbox):
    r = sandbox.run("import socket; socket.create_connection(('127.0.0.1', 22), timeout=2)")
    assert r.status == "runtime_error" and ("unreachable" in r.stderr or "refused" in r.stderr)


def test_host_files_are_not_visible(sandbox):
    repo = os.path.abspath(__file__)
    for path in ("/root/.bashrc", repo, "/etc/shadow"):
        r = sandbox.run(f"print(open({path!r}).read())")
        assert r.status == "runtime_error" and "No such file" in r.stderr, path


def test_writing_outside_tmp_fails(sandbox):
    for path in ("/usr/evil", "/sandbox/evil", "/evil"):
        r = sandbox.run(f"open({path!r}, 'w').write('x')")
        assert r.status == "runtime_error" and ("Read-only" in r.stderr or "Permission" in r.stderr), path
    assert not os.path.exists("/usr/evil")


def test_killing_the_parent_only_ends_the_sandbox(sandbox):
    r = sandbox.run("import os, signal; os.kill(os.getppid(), signal.SIGKILL); import time; time.sleep(5)", timeout_s=3)
    assert r.status in ("killed", "runtime_error", "timeout")
    assert os.getpid() > 0 and not leftover_sandbox_processes()


def test_children_and_setsid_escapes_die_with_the_sandbox(sandbox):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        signal = __import__('signal'); signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    r = sandbox.run(code, timeout_s=5)
    assert r.status == "ok" and r.stdout == "parent done\n"
    time.sleep(0.5)
    assert not leftover_sandbox_processes()


def test_a_normal_run_still_succeeds_after_the_battery(sandbox):
    assert sandbox.run("print(sum(range(10)))").stdout == "45\n"


def test_missing_bwrap_is_refused_unless_unsafe(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        LocalSandbox()
    assert LocalSandbox(unsafe=True).run("print(1)").stdout == "1\n"


def test_async_run(sandbox):
    import asyncio

    async def run():
        return await asyncio.gather(*(sandbox.arun(f"print({i})") for i in range(4)))

    assert [r.stdout for r in asyncio.run(run())] == ["0\n", "1\n", "2\n", "3\n"]


def test_runs_leave_nothing_for_the_next_run(sandbox):
    leave = (
        "for p in ('/tmp/x', '/dev/shm/x', '/dev/x'):\n"
        "    try:\n"
        "        open(p, 'w').write('secret')\n"
        "    except OSError:\n"
        "        pass\n"
    )
    assert sandbox.run(leave).status == "ok"
    r = sandbox.run("import os; print([p for p in ('/tmp/x', '/dev/shm/x', '/dev/x') if os.path.exists(p)])")
    assert r.stdout == "[]\n"


def test_the_fork_server_is_out_of_reach():
    """A run sees the fork server in /proc but cannot signal, read or trace it; the slot keeps working."""
    sandbox = LocalSandbox()
    code = (
        "import os, signal\n"
        "pids = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]\n"
        "for pid in pids:\n"
        "    for attack in (lambda: os.kill(pid, signal.SIGKILL), lambda: open(f'/proc/{pid}/mem', 'rb').read(1),\n"
        "                   lambda: open(f'/proc/{pid}/environ', 'rb').read()):\n"
        "        try:\n"
        "            attack()\n"
        "            print('reached', pid)\n"
        "        except OSError:\n"
        "            pass\n"
        "print(len(pids), 'out of reach')\n"
    )
    r = sandbox.run(code)
    assert r.status == "ok" and "reached" not in r.stdout and "out of reach" in r.stdout, r
    assert sandbox.run("print(2 + 2)").stdout == "4\n"


def test_no_capabilities_and_an_unprivileged_uid(sandbox):
    r = sandbox.run(
        "import os\nprint(os.getuid(), [l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')])"
    )
    uid, caps = r.stdout.split(" ", 1)
    assert uid == "65534" and set(eval(caps)) == {"0000000000000000"}, r.stdout
