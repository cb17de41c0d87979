"""How many intra-op threads the trainer thread takes when ``ppo.cpu_threads`` is 0."""

import pytest

from areal_agents.config import TrainConfig
from areal_agents.trainers import local_launcher as policy
from areal_agents.trainers.local_launcher import trainer_threads


@pytest.mark.parametrize(
    "staleness, backend, engine_threads, expected",
    [
        (0, "hf", 1, 4),  # synchronous: updates never overlap decoding, all cores
        (2, "hf", 1, 3),  # async with an in-process engine: leave it its thread
        (2, "hf", 3, 1),
        (2, "hf", 8, 1),  # never fewer than one
        (2, "hf", 0, 4),  # engine on torch's default: nothing to leave
        (2, "serve-model", 1, 3),  # a launched server decodes on this machine too
        (2, "sglang", 1, 4),  # on GPUs
    ],
)
def test_trainer_threads(monkeypatch, staleness, backend, engine_threads, expected):
    monkeypatch.setattr(policy, "DEFAULT_CPU_THREADS", 4)
    cfg = TrainConfig()
    cfg.rollout.max_staleness, cfg.engine.backend, cfg.engine.cpu_threads = staleness, backend, engine_threads
    assert trainer_threads(cfg) == expected


def test_servers_elsewhere_leave_all_cores_and_launched_ones_take_theirs(monkeypatch):
    monkeypatch.setattr(policy, "DEFAULT_CPU_THREADS", 4)
    cfg = TrainConfig()
    cfg.rollout.max_staleness, cfg.engine.backend, cfg.engine.num_servers = 1, "serve-model", 2
    assert trainer_threads(cfg) == 2  # two launched servers with one thread each
    cfg.engine.urls = ["http://10.0.0.5:30000"]
    assert trainer_threads(cfg) == 4  # running somewhere else


def test_launched_servers_take_all_cores_in_sync_runs_and_one_thread_beside_async_updates(monkeypatch, tmp_path):
    from areal_agents.engines.local_servers import server_command

    commands = []
    monkeypatch.setattr(
        policy, "open_engine", lambda e, *a, **k: commands.append(server_command(e, "m", "float32", 1, 0))
    )
    cfg = TrainConfig()
    cfg.engine.backend = "serve-model"
    policy.open_policy_engine("policy", cfg, "m", tmp_path)
    cfg.rollout.max_staleness = 2
    policy.open_policy_engine("policy", cfg, "m", tmp_path)
    threads = [c[c.index("--cpu-threads") + 1] for c in commands]
    assert threads == ["0", "1"]


def test_the_in_process_engine_takes_all_cores_in_sync_runs_and_its_threads_beside_async_updates(monkeypatch, tmp_path):
    asked = []
    monkeypatch.setattr(policy, "open_engine", lambda e, *a, **k: asked.append(e.cpu_threads))
    for staleness in (0, 2):
        cfg = TrainConfig()
        cfg.rollout.max_staleness = staleness
        policy.open_policy_engine("policy", cfg, "m", tmp_path)
    assert asked == [0, TrainConfig().engine.cpu_threads]  # 0: torch's default, every core
