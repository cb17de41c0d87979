"""The bottleneck report on hand-made runs bound on purpose: where the time went, the bound it names and the
config key its advice names (a real key of the train config, with the run's value quoted)."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest

from areal_agents.config import TrainConfig
from areal_agents.timeline import bottleneck
from areal_agents.timeline import recorder as rec
from areal_agents.timeline.bottleneck import bottleneck_report, report_lines
from tests.timeline.fake_run import Clock, Process, record, sync_steps, write_run

CONFIG = {
    "rollout": {"max_staleness": 0, "max_concurrent_rollouts": 64},
    "ppo": {"ppo_epochs": 1, "num_minibatches": 1, "micro_batch_tokens": 16384},
    "env": {"workers": 4},
    "engine": {"num_servers": 1, "weight_sync": "auto"},
    "eval": {"every": 0, "num_problems": 200},
    "save_every": 0,
}


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(rec, "time", c)
    return c


def with_config(**changes: dict) -> dict:
    cfg = json.loads(json.dumps(CONFIG))
    for section, values in changes.items():
        cfg[section].update(values)
    return cfg


def add_episodes(p: Process, generate: float, env_step: float, parallel: int = 4) -> None:
    """Within each rollout wait, ``parallel`` episodes alternate generating and env steps until it ends."""
    waits = [(a, b) for track, name, a, b, _ in p.spans if name == "rollout_wait"]
    for w, (a, b) in enumerate(waits):
        for k in range(parallel):
            eid, t, turn = f"s{w}-{k}", a, 0
            p.span("episodes", "episode", a, b, episode_id=eid)
            while t + generate + env_step <= b + 1e-9:
                p.span("episodes", "generate", t, t + generate, episode_id=eid, turn=turn)
                p.span("episodes", "env_step", t + generate, t + generate + env_step, episode_id=eid, turn=turn)
                t, turn = t + generate + env_step, turn + 1


def make(tmp_path, clock, config=None, processes=(), episodes=None, **steps) -> Path:
    driver = Process("driver")
    end = sync_steps(driver, **{"steps": 4, **steps})
    if episodes:
        add_episodes(driver, *episodes)
    run_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"  # a fresh one each call
    return write_run(run_dir, clock, [driver, *processes], until=end, config=config or CONFIG)


def test_long_generations_bind_the_rollout_side(tmp_path, clock):
    run = make(tmp_path, clock, wait=1.6, update=0.3, episodes=(0.35, 0.05))
    r = bottleneck_report(run)
    assert r.bound == "rollout/generation" and r.steps == 4
    assert r.time["rollout wait"] == pytest.approx(0.8, abs=0.01) and r.time["training"] == pytest.approx(
        0.15, abs=0.01
    )
    assert r.episode_time["generate"] > 0.8 and r.idle["trainer/default"] == pytest.approx(0.85, abs=0.03)
    # the engine was busy all the while the trainer waited, and stopped during updates: let it run ahead
    assert r.key == "rollout.max_staleness" and "(now 0)" in r.advice and "80%" in r.advice


def test_a_busy_engine_that_already_runs_ahead_wants_more_servers(tmp_path, clock):
    r = bottleneck_report(make(tmp_path, clock, with_config(rollout={"max_staleness": 2}), wait=1.6, update=0.3))
    assert r.bound == "rollout/generation" and r.key == "engine.num_servers" and "(now 1)" in r.advice


def test_an_engine_idle_while_the_trainer_waits_wants_more_episodes_in_flight(tmp_path, clock):
    driver = Process("driver")
    end = sync_steps(driver, steps=4, wait=1.6, update=0.3)
    driver.busy["engine/hf"] = [(a, a + 0.4) for _, name, a, _, _ in driver.spans if name == "rollout_wait"]
    r = bottleneck_report(write_run(tmp_path / "run", clock, [driver], until=end, config=CONFIG))
    assert r.bound == "rollout/generation" and r.key == "rollout.max_concurrent_rollouts"
    assert r.busy_while_waiting["engine/hf"] == pytest.approx(0.25, abs=0.02) and "only 25%" in r.advice


def test_a_heavy_update_binds_training(tmp_path, clock):
    cfg = with_config(ppo={"ppo_epochs": 4})
    r = bottleneck_report(make(tmp_path, clock, cfg, wait=0.3, update=1.5))
    assert r.bound == "training" and r.time["training"] == pytest.approx(1.5 / 1.9, abs=0.01)
    assert r.key == "ppo.ppo_epochs" and "(now 4)" in r.advice and "lower" in r.advice
    assert r.idle["engine/hf"] > 0.8


def test_a_heavy_update_in_a_synchronous_run_that_also_waits_wants_overlap(tmp_path, clock):
    r = bottleneck_report(make(tmp_path, clock, wait=0.6, update=1.5))
    assert r.bound == "training" and r.key == "rollout.max_staleness"


def test_slow_env_steps_bind_the_env(tmp_path, clock):
    driver = Process("driver", gauges={"env/steps_in_flight": lambda t: 4.0})
    end = sync_steps(driver, steps=4, wait=1.6, update=0.3)
    add_episodes(driver, 0.05, 0.35)
    waits = [(a, b) for _, n, a, b, _ in driver.spans if n == "rollout_wait"]
    slots = {f"env/pool/{k}": waits for k in range(4)}  # the pool's 4 workers, all busy while the trainer waits
    r = bottleneck_report(write_run(tmp_path / "run", clock, [driver, Process("env", busy=slots)], end, CONFIG))
    assert r.bound == "env" and r.episode_time["env"] > 0.8
    assert r.key == "env.workers" and "4.0 env steps in flight" in r.advice and "(now 4)" in r.advice
    lines = r.lines()
    assert any(line.startswith("  env calls      80%") for line in lines), lines
    assert "env/pool (4) 20%" in next(line for line in lines if line.startswith("idle share:"))


def test_slow_env_steps_with_free_env_workers_want_more_episodes(tmp_path, clock):
    run = make(tmp_path, clock, with_config(env={"workers": 64}), wait=1.6, update=0.3, episodes=(0.05, 0.35))
    r = bottleneck_report(run)
    assert r.bound == "env" and r.key == "rollout.max_concurrent_rollouts"


def test_a_busy_reward_service_binds_rewards(tmp_path, clock):
    driver = Process("driver")
    end = sync_steps(driver, steps=4, wait=1.6, update=0.3)
    driver.busy["engine/hf"] = [(a, a + 0.3) for _, name, a, _, _ in driver.spans if name == "rollout_wait"]
    waits = [(a, b) for _, n, a, b, _ in driver.spans if n == "rollout_wait"]
    reward = Process("reward", busy={"reward/service": waits})
    r = bottleneck_report(write_run(tmp_path / "run", clock, [driver, reward], until=end, config=CONFIG))
    assert r.bound == "reward" and r.key == "env.workers"


def test_slow_weight_pushes_bind_weight_sync(tmp_path, clock):
    r = bottleneck_report(make(tmp_path, clock, wait=0.3, update=0.3, push=1.2))
    assert r.bound == "weight sync" and r.key == "engine.weight_sync" and "1.20 s each" in r.advice
    r = bottleneck_report(
        make(tmp_path, clock, with_config(engine={"weight_sync": "broadcast"}), wait=0.3, update=0.3, push=1.2)
    )
    assert r.key == "engine.weight_sync_bucket_mb"


def test_eval_and_checkpoints_can_bind_too(tmp_path, clock):
    assert bottleneck_report(make(tmp_path, clock, wait=0.3, update=0.3, eval=1.5)).key == "eval.num_problems"
    r = bottleneck_report(make(tmp_path, clock, wait=0.3, update=0.3, checkpoint=1.5))
    assert (r.bound, r.key) == ("checkpoint", "save_every")


def test_even_phases_are_balanced(tmp_path, clock):
    r = bottleneck_report(make(tmp_path, clock, wait=0.9, update=0.85))
    assert r.bound == "balanced" and r.key == "rollout.max_staleness"


def test_without_steps_the_busiest_kind_of_worker_is_the_bound(tmp_path, clock):
    engine = Process("server", busy={"engine/hf": [(0.0, 2.7)], "gpu0": [(0.0, 1.0)]})
    r = bottleneck_report(write_run(tmp_path / "run", clock, [engine], until=3.0))
    assert r.bound == "rollout/generation" and r.steps == 0 and r.wall_s == pytest.approx(3.0, abs=0.11)
    assert r.key == "engine.num_servers" and "engine/hf was busy 9" in r.advice


def test_the_report_reads_as_lines_and_as_json(tmp_path, clock):
    r = bottleneck_report(make(tmp_path, clock, wait=1.6, update=0.3))
    lines = r.lines()
    assert lines[0].startswith("where the time went (") and "4 steps" in lines[0]
    assert lines[-2] == "bound: rollout/generation" and lines[-1] == f"advice: {r.advice}"
    assert report_lines(r.run_dir) == lines
    data = json.loads(json.dumps(r.to_json()))
    assert data["bound"] == "rollout/generation" and data["idle"]["engine/hf"] == r.idle["engine/hf"]


def test_report_lines_never_raise(tmp_path, monkeypatch):
    assert report_lines(tmp_path) == []  # no timeline

    def broken(run_dir):
        raise OSError("disk gone")

    monkeypatch.setattr(bottleneck, "read_timeline", broken)
    assert report_lines(tmp_path) == ["bottleneck report: not available (OSError: disk gone)"]


def test_every_key_the_advice_may_name_is_a_train_config_key():
    source = Path(bottleneck.__file__).read_text()
    keys = set(re.findall(r'"((?:rollout|ppo|env|engine|eval|timeline)\.[a-z_]+|save_every(?:_minutes)?)"', source))
    keys |= set(re.findall(r"(?<![\w.])((?:rollout|ppo|env|engine|eval|timeline)\.[a-z_]+)\b", source))
    assert {
        "rollout.max_staleness",
        "engine.num_servers",
        "env.workers",
        "ppo.ppo_epochs",
        "timeline.heatmap_every",
    } <= keys
    for key in keys:
        node = TrainConfig
        for part in key.split("."):
            fields = {f.name: f for f in dataclasses.fields(node)}
            assert part in fields, f"the advice names {key!r}, not a key of the train config"
            node = typing.get_type_hints(node)[part]


def test_a_resumed_run_leaves_out_its_stop(tmp_path, clock, monkeypatch):
    """Two sessions of 4 steps, each its own driver process, 100 s apart: the stop is neither wall time nor
    "other", nor the first eval of the second session (before its first step)."""
    first, second = Process("driver"), Process("driver")
    end = sync_steps(first, steps=4, wait=1.6, update=0.3)
    for track, name, a, b, args in first.spans:
        second.span(track, name, a + 100, b + 100, **{**args, "step": args["step"] + 4})
    second.span("driver", "eval", 99.0, 100.4, step=4)
    second.busy = {w: [(a + 100, b + 100) for a, b in ivs] for w, ivs in first.busy.items()}
    for pid, p, since, until in ((1, first, 0, end), (2, second, 99, end + 100)):
        monkeypatch.setattr(rec.os, "getpid", lambda pid=pid: pid)
        record(tmp_path / "run", clock, p, until, since)
    r = bottleneck_report(tmp_path / "run", config=CONFIG)
    assert r.steps == 8 and r.wall_s == pytest.approx(16.0, abs=0.01) and r.stopped_s == pytest.approx(92.0)
    assert r.time["other"] == 0 and r.time["eval"] == 0
    assert r.bound == "rollout/generation" and "s stopped, left out" in r.lines()[0]
    assert {w: round(b, 1) for w, b in r.busy.items()} == {"driver.1:engine/hf": 0.8, "driver.2:engine/hf": 0.8} | {
        "driver.1:trainer/default": 0.1,
        "driver.2:trainer/default": 0.1,
    }


def test_a_phase_must_take_half_again_the_next_to_bind(tmp_path, clock):
    # an asynchronous run's update (0.44) beside its rollout wait (0.33): 1.33x is no clear bound
    assert bottleneck_report(make(tmp_path, clock, wait=0.66, update=0.88)).bound == "balanced"
    assert bottleneck_report(make(tmp_path, clock, wait=0.5, update=0.8)).bound == "training"


def test_time_in_no_phase_binds_when_it_dominates(tmp_path, clock):
    cfg = {**CONFIG, "timeline": {"heatmap_every": 1}}
    r = bottleneck_report(make(tmp_path, clock, cfg, wait=0.3, update=0.2, push=0.1, **{"log": 2.0}))
    assert r.time["other"] > 0.7 and r.bound == "driver overhead"
    assert r.key == "timeline.heatmap_every" and "(now 1)" in r.advice
    r = bottleneck_report(make(tmp_path, clock, wait=1.0, update=0.2, push=0.1, **{"log": 1.2}))
    assert r.bound == "rollout/generation"  # other at 1.2x the wait: the phases decide
