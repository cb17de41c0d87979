"""Chaos for training: runs that cannot make progress stop. An env server that dies mid-run, an env whose
every step raises, and a server that answers 400 to every step each end the run quickly with a non-zero
exit, one last line naming the cause, a small log, and a checkpoint of the last finished step where one
existed (before: the first spun for minutes writing hundreds of MB of tracebacks, the second never finished
step 1, the third ended with exit 0 and the 400 reported as a 404)."""

import subprocess
import sys
import time

import pytest
from chaos_fuzz import report
from test_train_interrupts import steps_logged

from areal_agents.envs.runtime.remote import EnvServerProcess

pytestmark = pytest.mark.slow
LIVENESS_S = 180  # far above the ~60 s the runs are designed to take: a hang fails, a loaded machine does not


def write_config(
    tmp_path, tiny_dir, server_url, env_id="areal_agents/Arithmetic-v0", kwargs="{digits: 1}", eval_kwargs="{}"
):
    config = tmp_path / "rl.yaml"
    config.write_text(
        f"model: {{path: {tiny_dir}}}\nsteps: 30\nrun_dir: {tmp_path / 'run'}\n"
        f"env: {{id: {env_id}, kwargs: {kwargs}, backend: server, server_url: {server_url}}}\n"
        f"eval: {{num_problems: {1 if 'Faulty' in env_id else 4}, env_kwargs: {eval_kwargs}}}\n"
        "rollout: {batch_size: 4, group_size: 4, max_new_tokens: 4, max_staleness: 1}\n"
        "ppo: {filter_zero_variance_groups: false}\n"
    )
    return config


def start_train(config, log_path):
    log = open(log_path, "w")
    command = [sys.executable, "-m", "areal_agents.cli", "train", str(config), "--no-progress"]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log


def finish(proc, log, log_path, name, started):
    """Wait for the run; its exit code, its last line, the log's size and how long it took (reported)."""
    rc = proc.wait(timeout=LIVENESS_S)
    log.close()
    text = log_path.read_text(errors="replace")
    last = text.strip().splitlines()[-1]
    seconds, size = time.monotonic() - started, log_path.stat().st_size
    report(f"chaos run halts ({name}): exit {rc} after {seconds:.0f} s, log {size} bytes | {last}")
    return rc, last, size


def test_a_run_whose_env_server_dies_stops_with_a_checkpoint(tmp_path, tiny_dir):
    server = EnvServerProcess(workers=2)
    config = write_config(tmp_path, tiny_dir, server.url)
    started = time.monotonic()
    proc, log = start_train(config, tmp_path / "train.log")
    try:
        deadline = time.monotonic() + LIVENESS_S
        while proc.poll() is None and not steps_logged(tmp_path / "run") and time.monotonic() < deadline:
            time.sleep(0.05)
        server.stop()  # the server dies after the run's first step
        rc, last, size = finish(proc, log, tmp_path / "train.log", "env server died", started)
    finally:
        proc.kill()
        server.stop()
    assert rc != 0
    assert "areal-agents train: error:" in last and ("unreachable" in last or "server_lost" in last), last
    assert size < 1 << 20
    done = max(steps_logged(tmp_path / "run"))
    assert (tmp_path / "run" / "checkpoints" / f"step_{done}").is_dir(), "the last finished step is saved"
    assert (tmp_path / "run" / "failures.log").is_file()


def test_a_run_whose_env_raises_at_every_step_stops(tmp_path, tiny_dir):
    with EnvServerProcess(workers=2, module="areal_agents.envs.testing") as server:
        env = "areal_agents_testing/Faulty-v0"  # every training step raises; the held-out eval's do not
        config = write_config(tmp_path, tiny_dir, server.url, env, "{error_rate: 1.0}", "{error_rate: 0.0}")
        started = time.monotonic()
        proc, log = start_train(config, tmp_path / "train.log")
        try:
            rc, last, size = finish(proc, log, tmp_path / "train.log", "env raises", started)
        finally:
            proc.kill()
    assert rc != 0
    assert "rollout.max_failed_fraction" in last and "env_failed" in last and "injected env failure" in last, last
    assert size < 1 << 20
    assert steps_logged(tmp_path / "run") == []  # no step finished: no checkpoint to write
    assert not (tmp_path / "run" / "checkpoints").is_dir() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_a_run_refused_with_400_at_every_step_stops_at_once_labelled_400(tmp_path, tiny_dir):
    with EnvServerProcess(workers=2, max_action_chars=1) as server:  # longer actions: 400 action_too_long
        config = write_config(tmp_path, tiny_dir, server.url)
        started = time.monotonic()
        proc, log = start_train(config, tmp_path / "train.log")
        try:
            rc, last, size = finish(proc, log, tmp_path / "train.log", "400 at every step", started)
        finally:
            proc.kill()
    assert rc != 0
    assert "action_too_long (400)" in last and "(404)" not in last, last
    assert size < 1 << 20
