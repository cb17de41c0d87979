"""Chaos for training: a run stopped by SIGTERM mid-step leaves nothing behind (issue 45 item 4): no process
it started (env and model servers, the trainer process, worker pools) outlives it, and no session stays open
on an env server it did not start. A run SIGKILLed instead cannot clean up: the next start of the same run
directory closes what the killed one left open on the external server (its sessions, by owner), and the
servers it started go with it (parent-death signal)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from chaos_fuzz import report
from test_train_interrupts import steps_logged

from areal_agents.envs.runtime.remote import EnvServerProcess

pytestmark = [pytest.mark.process, pytest.mark.slow]
LIVENESS_S = 300  # far above what the runs take: a hang fails, a loaded machine does not


def write_config(tmp_path, tiny_dir, env, engine="hf", trainer="thread"):
    config = tmp_path / "rl.yaml"
    config.write_text(
        f"model: {{path: {tiny_dir}}}\nsteps: 50\nrun_dir: {tmp_path / 'run'}\n"
        f"env: {{id: areal_agents/Arithmetic-v0, kwargs: {{digits: 1, max_turns: 2}}, {env}}}\n"
        "eval: {num_problems: 2}\n"
        "rollout: {batch_size: 2, group_size: 2, max_new_tokens: 4, max_staleness: 1}\n"
        f"engine: {{backend: {engine}}}\nppo: {{filter_zero_variance_groups: false, trainer: {trainer}}}\n"
    )
    return config


def start_train(config, log_path, *extra):
    log = open(log_path, "w")
    command = [sys.executable, "-m", "areal_agents.cli", "train", str(config), "--no-progress", *extra]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log


def sessions_open(url):
    with urllib.request.urlopen(f"{url}/health", timeout=10) as reply:
        return json.loads(reply.read())["sessions_open"]


def alive(pid):
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid):
    """Every live process under ``pid`` (children, theirs, ...), from /proc: {pid: command line}."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = {}, [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if alive(child):
                try:
                    found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
                except OSError:
                    continue
                todo.append(child)
    return found


def wait_until(predicate, proc, what):
    """Poll ``predicate`` until true; fails if the run ends first or takes past `LIVENESS_S`."""
    deadline = time.monotonic() + LIVENESS_S
    while not predicate():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {LIVENESS_S}s"
        time.sleep(0.05)


def mid_step(proc, run_dir, url):
    """Wait until the run has finished a step and holds sessions on the server at ``url``."""
    wait_until(lambda: steps_logged(run_dir), proc, "finished step")
    wait_until(lambda: sessions_open(url) > 0, proc, "open session")


def survivors(tree, grace_s=30.0):
    """The processes of ``tree`` still running ``grace_s`` seconds on (each may take its time to stop)."""
    deadline = time.monotonic() + grace_s
    while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {pid: command for pid, command in tree.items() if alive(pid)}


@pytest.mark.parametrize("servers", ["external", "own"])
def test_a_run_stopped_by_sigterm_mid_step_leaves_no_process_and_no_session(tmp_path, tiny_dir, servers):
    with EnvServerProcess(workers=2) as external:
        if servers == "external":
            config = write_config(tmp_path, tiny_dir, f"backend: server, server_url: {external.url}")
        else:  # its own serve-env server (its env worker pool under it), serve-model server and trainer process
            config = write_config(tmp_path, tiny_dir, "backend: server", engine="serve-model", trainer="process")
        proc, log = start_train(config, tmp_path / "train.log")
        try:
            run_dir = tmp_path / "run"
            if servers == "external":
                mid_step(proc, run_dir, external.url)
            else:
                wait_until(lambda: steps_logged(run_dir), proc, "finished step")
            tree = descendants(proc.pid)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=LIVENESS_S)
            left = survivors(tree)
            still_open = sessions_open(external.url)
        finally:
            proc.kill()
            log.close()
    text = (tmp_path / "train.log").read_text(errors="replace")
    report(
        f"chaos run releases (SIGTERM, {servers} servers): exit {rc}; {len(tree)} processes under the driver, "
        f"{len(left)} left; external sessions open after: {still_open}"
    )
    assert rc == 143, text[-2000:]  # 128 + SIGTERM, as documented (docs/quickstart.md)
    if servers == "own":
        commands = " | ".join(tree.values())
        assert "serve-env" in commands and "serve-model" in commands, commands  # the run did start them
    assert not left, f"processes outlived the run: {left}"
    assert still_open == 0
    assert "stopped by SIGTERM" in text, text[-2000:]


def test_a_run_that_stops_on_an_error_leaves_no_session_open(tmp_path, tiny_dir):
    with EnvServerProcess(workers=2, max_action_chars=1) as external:  # every step: 400 action_too_long
        config = write_config(tmp_path, tiny_dir, f"backend: server, server_url: {external.url}")
        proc, log = start_train(config, tmp_path / "train.log")
        try:
            rc = proc.wait(timeout=LIVENESS_S)
        finally:
            proc.kill()
            log.close()
        still_open = sessions_open(external.url)
    last = (tmp_path / "train.log").read_text(errors="replace").strip().splitlines()[-1]
    report(f"chaos run releases (error): exit {rc} | {last}; external sessions open after: {still_open}")
    assert rc == 2 and "action_too_long (400)" in last, last
    assert still_open == 0


def test_a_sigkilled_run_takes_its_processes_along_and_the_next_start_closes_its_sessions(tmp_path, tiny_dir):
    with EnvServerProcess(workers=2) as external:
        env = f"backend: server, server_url: {external.url}"
        config = write_config(tmp_path, tiny_dir, env, engine="serve-model", trainer="process")
        run_dir = tmp_path / "run"
        proc, log = start_train(config, tmp_path / "killed.log")
        try:
            mid_step(proc, run_dir, external.url)
            tree = descendants(proc.pid)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
        finally:
            proc.kill()
            log.close()
        left = survivors(tree)  # the model server by the parent-death signal, the trainer by its parent watch
        left_open = sessions_open(external.url)  # nothing closes them now but the server's idle expiry (600 s)
        assert left_open > 0
        resume = ["--resume"] if any((run_dir / "checkpoints").glob("step_*")) else ["--overwrite"]
        proc, log = start_train(config, tmp_path / "next.log", *resume, "steps=1")
        try:
            rc = proc.wait(timeout=LIVENESS_S)
        finally:
            proc.kill()
            log.close()
        still_open = sessions_open(external.url)
    text = (tmp_path / "next.log").read_text(errors="replace")
    closed = re.search(r"closed (\d+) sessions? the run left open", text)
    report(
        f"chaos run releases (SIGKILL, next start): {len(tree)} processes under the driver, {len(left)} left; "
        f"{left_open} sessions left open; the next start {closed.group(0) if closed else 'closed none'}, "
        f"exit {rc}; open after: {still_open}"
    )
    assert "serve-model" in " | ".join(tree.values()) and not left, f"processes outlived the run: {left}"
    assert closed is not None and int(closed.group(1)) == left_open, text[-2000:]
    assert rc == 0, text[-2000:]
    assert still_open == 0


def test_a_worker_busy_in_a_call_dies_with_its_sigkilled_parent(tmp_path):
    """An idle worker sees its pipe close when its parent dies; one in the middle of a long call (a hung env
    step, a trainer's update) would not, and runs on, orphaned, without the parent watch."""
    busy = tmp_path / "busy"
    script = (
        "import sys, time\nfrom areal_agents.workers import WorkerPool\npool = WorkerPool(1)\n"
        "print(pool.pids[0], flush=True)\n"
        f"pool.call_sync(exec, {f'import pathlib, time; pathlib.Path({str(busy)!r}).touch(); time.sleep(600)'!r})\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    worker = int(parent.stdout.readline())
    try:
        wait_until(busy.exists, parent, "the worker's call")
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=60)
        left = survivors({worker: "worker"})
    finally:
        parent.kill()
        parent.stdout.close()
        if alive(worker):
            os.kill(worker, signal.SIGKILL)
    assert not left
