"""How many intra-op threads the engine's decode thread and the trainer take: the keys, or auto (0) from the
cores (`areal_agents.config.placement`) and what shares them; and that each thread runs with its count."""

import asyncio
from dataclasses import replace

import pytest
import torch

from areal_agents.config import TrainConfig, placement
from areal_agents.trainers import local_launcher as policy
from areal_agents.trainers.local_launcher import LocalLauncher, engine_threads, trainer_threads
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.types import GenRequest, SamplingParams, Trajectory


@pytest.fixture
def five_cores(monkeypatch):
    """auto sees 5 usable cores: teams of 4, one core left to the event loop."""
    monkeypatch.setattr(placement, "usable_cores", lambda: 5)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.parametrize(
    "staleness, backend, engine_threads_key, expected",
    [
        (0, "hf", 0, 4),  # synchronous: updates never overlap decoding; all cores less the event loop's
        (0, "hf", 3, 4),  # ... whatever the engine's key
        (2, "hf", 0, 3),  # async with an in-process engine: auto leaves it one thread
        (2, "hf", 3, 1),
        (2, "hf", 8, 1),  # never fewer than one
        (2, "serve-model", 0, 3),  # a launched server decodes on this machine too
        (2, "sglang", 0, 4),  # on GPUs
    ],
)
def test_trainer_threads(five_cores, staleness, backend, engine_threads_key, expected):
    cfg = TrainConfig()
    cfg.rollout.max_staleness, cfg.engine.backend, cfg.engine.cpu_threads = staleness, backend, engine_threads_key
    assert trainer_threads(cfg) == expected


def test_an_engine_count_set_holds_in_sync_and_async_runs(five_cores):
    cfg = TrainConfig()
    cfg.engine.cpu_threads = 3
    assert engine_threads(cfg) == 3
    cfg.rollout.max_staleness = 2
    assert engine_threads(cfg) == 3


def test_servers_elsewhere_leave_all_cores_and_launched_ones_take_theirs(five_cores):
    cfg = TrainConfig()
    cfg.rollout.max_staleness, cfg.engine.backend, cfg.engine.num_servers = 1, "serve-model", 2
    assert trainer_threads(cfg) == 2  # two launched servers with one thread each
    cfg.engine.urls = ["http://10.0.0.5:30000"]
    assert trainer_threads(cfg) == 4  # running somewhere else


def test_auto_on_small_machines_and_under_omp_num_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [placement.team_threads(cores=c) for c in (1, 2, 3, 9)] == [1, 1, 2, 8]
    assert placement.team_threads(sharers=2, cores=9) == 4  # two servers decoding at once
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert placement.team_threads(cores=9) == 3  # the user's cap for the whole process


def test_usable_cores_follow_affinity_and_a_cgroup_quota(monkeypatch, tmp_path):
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(placement, "CGROUP_CPU_MAX", tmp_path / "cpu.max")
    assert placement.usable_cores() == 4  # no cgroup file
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert placement.usable_cores() == 4
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # docker --cpus=1.5
    assert placement.usable_cores() == 2


def test_launched_servers_share_the_cores_in_sync_runs_and_take_one_thread_beside_async_updates(
    monkeypatch, tmp_path, five_cores
):
    from areal_agents.engines.local_servers import server_command

    commands = []
    monkeypatch.setattr(
        policy, "open_engine", lambda e, *a, **k: commands.append(server_command(e, "m", "float32", 1, 0))
    )
    cfg = TrainConfig()
    cfg.engine.backend, cfg.engine.num_servers = "serve-model", 2
    policy.open_policy_engine("policy", cfg, "m", tmp_path)
    cfg.rollout.max_staleness = 2
    policy.open_policy_engine("policy", cfg, "m", tmp_path)
    threads = [c[c.index("--cpu-threads") + 1] for c in commands]
    assert threads == ["2", "1"]  # 4 cores for two servers that decode at once; then one each


def test_the_in_process_engine_takes_the_cores_in_sync_runs_and_one_thread_beside_async_updates(
    monkeypatch, tmp_path, five_cores
):
    asked = []
    monkeypatch.setattr(policy, "open_engine", lambda e, *a, **k: asked.append(e.cpu_threads))
    for staleness in (0, 2):
        cfg = TrainConfig()
        cfg.rollout.max_staleness = staleness
        policy.open_policy_engine("policy", cfg, "m", tmp_path)
    assert asked == [4, 1]


def test_the_decode_thread_and_the_trainer_thread_each_run_with_their_count(tiny_dir, tmp_path):
    """A policy opened as the launcher opens it (a trainer thread, the in-process engine): each thread reads
    ``torch.get_num_threads()`` as it works, and this thread keeps its own count."""
    cfg = TrainConfig(run_dir=str(tmp_path))
    cfg.model.path, cfg.engine.cpu_threads, cfg.ppo.cpu_threads = str(tiny_dir), 3, 2
    before = torch.get_num_threads()
    opened = LocalLauncher(cfg).open_policy("policy", str(tiny_dir), str(tiny_dir), TrainSpec.of(cfg, 0))
    seen: dict[str, int] = {}
    runner = opened.engine._scheduler.runner  # noqa: SLF001  (its decode thread calls runner.step)
    step, train_step = runner.step, opened.train_step
    runner.step = lambda *a: (seen.setdefault("decode", torch.get_num_threads()), step(*a))[1]
    opened.train_step = lambda *a, **k: (seen.setdefault("trainer", torch.get_num_threads()), train_step(*a, **k))[1]

    async def rollout_then_update():
        response = await opened.engine.agenerate(GenRequest("r", [1, 2, 3], SamplingParams(max_new_tokens=2)))
        n = len(response.output_tokens)
        done = Trajectory(
            input_ids=[1, 2, 3, *response.output_tokens],
            loss_mask=[0, 0, 0] + [1] * n,
            logprobs=[0.0, 0.0, 0.0, *response.output_logprobs],
            versions=[-1, -1, -1] + [0] * n,
        )
        group = [replace(done, reward=float(r), group_id="g") for r in (0, 1)]
        await opened.update(group, torch.Generator().manual_seed(0))

    try:
        asyncio.run(rollout_then_update())
    finally:
        opened.close()
    assert seen == {"decode": 3, "trainer": 2}
    assert torch.get_num_threads() == before
