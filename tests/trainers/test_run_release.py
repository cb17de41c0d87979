"""The run's owner record (`RunSessions`): one name per run directory and host, a directory a live run holds is
refused, a record left by a process that is gone is taken over, and release removes it. (Closing sessions on a
real server, after SIGTERM and after SIGKILL: tests/chaos/test_run_releases.py.)"""

import json
import os
import re
from dataclasses import replace

import pytest

from areal_agents.config import TrainConfig
from areal_agents.errors import ConfigError
from areal_agents.trainers.run_release import RECORD, RunSessions, _started, external_servers, run_owner


def test_the_owner_name_is_stable_per_directory_and_fits_the_protocol(tmp_path):
    odd = tmp_path / ("run with spaces/é" + "x" * 200)
    names = [run_owner(tmp_path / "a"), run_owner(tmp_path / "a"), run_owner(tmp_path / "b"), run_owner(odd)]
    assert names[0] == names[1] and names[0] != names[2]
    for name in names:  # docs/env-protocol.md: 1..128 characters of [A-Za-z0-9_.:-]
        assert re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", name), name
    assert run_owner(tmp_path / "a").startswith("areal:a:")


def test_only_servers_the_run_did_not_start_are_external():
    cfg = TrainConfig()
    external = replace(cfg, env=replace(cfg.env, backend="server", server_url="http://10.0.0.1:8765/"))
    assert external_servers(external) == ["http://10.0.0.1:8765"]
    assert external_servers(replace(external, env=replace(external.env, server_url=""))) == []  # launched by the run
    assert external_servers(cfg) == []  # envs in this process
    assert external_servers(replace(external, launcher="ray")) == []  # Ray starts its own env servers


def test_a_directory_a_live_run_holds_is_refused(tmp_path):
    live = os.getppid()  # a process of this host that runs now
    record = {"owner": run_owner(tmp_path), "pid": live, "started": _started(live), "host": os.uname().nodename}
    (tmp_path / RECORD).write_text(json.dumps({**record, "servers": []}))
    with pytest.raises(ConfigError, match=rf"run_dir {tmp_path} is in use: process {live} still runs it"):
        RunSessions.claim(tmp_path, TrainConfig())
    assert json.loads((tmp_path / RECORD).read_text())["pid"] == live  # left as it was


@pytest.mark.parametrize("left", ["a process that is gone", "a reused pid", "a torn record"])
def test_a_record_left_by_a_killed_run_is_taken_over_and_release_removes_it(tmp_path, left):
    record = {"owner": run_owner(tmp_path), "pid": os.getppid(), "started": "1", "host": os.uname().nodename}
    if left == "a process that is gone":
        record["pid"], record["started"] = 2**22 + 1, "1"  # above Linux's pid_max: never runs
    text = "{not json" if left == "a torn record" else json.dumps({**record, "servers": []})
    (tmp_path / RECORD).write_text(text)
    sessions = RunSessions.claim(tmp_path, TrainConfig())
    assert (tmp_path / RECORD).read_text() == text  # claim writes nothing
    sessions.hold()
    mine = json.loads((tmp_path / RECORD).read_text())
    assert mine["pid"] == os.getpid() and mine["owner"] == sessions.owner == run_owner(tmp_path)
    assert mine["started"] == _started(os.getpid()) and mine["servers"] == []
    sessions.release()
    assert not (tmp_path / RECORD).exists()
