"""A real short RL run records its timeline: the engine's, the trainer's and the env pool's busy rows, the
queues, CPU use, and the driver's and the episodes' spans, each episode's calls named by its id."""

from __future__ import annotations

import numpy as np
import pytest

from areal_agents.config import TrainConfig, load_config
from areal_agents.timeline import read_timeline, timeline
from areal_agents.timeline.recorder import NULL
from areal_agents.trainers.rl_recipe import run_train

pytestmark = pytest.mark.slow


def _config(run, tiny_dir, *extra):
    return load_config(
        TrainConfig,
        None,
        [
            f"run_dir={run}", f"model.path={tiny_dir}", "steps=3", "eval.num_problems=4", "save_every=2",
            "env.kwargs={digits: 1}", "rollout.batch_size=8", "rollout.group_size=4", "rollout.max_new_tokens=24",
            "rollout.max_staleness=1", "ppo.filter_zero_variance_groups=false", *extra,
        ],
    )  # fmt: skip


def test_a_run_records_every_worker_queue_and_event(tmp_path, tiny_dir):
    run = tmp_path / "rl"
    run_train(_config(run, tiny_dir), progress=False)
    assert timeline() is NULL  # closed with the run
    tl = read_timeline(run)
    assert {"engine/hf", "trainer/policy", "env/pool/0"} <= set(tl.busy)
    for worker in ("engine/hf", "trainer/policy", "env/pool/0"):
        assert 0 < tl.busy_share(worker) < 1, worker
    for gauge in ("rollout/queued_groups", "rollout/running_groups", "rollout/episodes_running",
                  "engine/hf/waiting", "engine/hf/running", "env/steps_in_flight", "cpu/driver"):  # fmt: skip
        assert np.isfinite(tl.gauges[gauge]).sum() >= 3, gauge
    assert np.nanmax(tl.gauges["rollout/episodes_running"]) > 0
    driver = [s for s in tl.spans if s.track == "driver"]
    names = [s.name for s in driver]
    assert [s.args["step"] for s in driver if s.name == "step"] == [1, 2, 3]
    assert names.count("weight_push") == 3 and names.count("rollout_wait") >= 3
    # streamed (max_staleness 1): parts of an update as groups come, then one optimizer step per step
    assert len([s for s in driver if s.name == "update" and not s.args.get("part")]) == 3
    assert names.count("eval") == 2 and names.count("checkpoint") == 2  # before and after; step 2 and the end
    episodes = [s for s in tl.spans if s.name == "episode"]
    assert len(episodes) >= 3 * 8 * 4 and all(s.args["outcome"] == "accepted" for s in episodes)
    ids = {s.args["episode_id"] for s in episodes}
    generates = [s for s in tl.spans if s.name == "generate"]
    steps = [s for s in tl.spans if s.name == "env_step"]
    assert generates and steps and all(s.args["episode_id"] in ids for s in generates + steps)
    # the trainer's busy time is its updates' time: the rows and the spans tell the same story
    updates = sum(s.end - s.start for s in driver if s.name == "update")
    busy = np.nansum(tl.busy["trainer/policy"]) * tl.dt
    assert 0.5 * updates <= busy <= updates + 0.3


@pytest.mark.process
def test_a_trainer_process_records_into_the_runs_timeline(tmp_path, tiny_dir):
    run = tmp_path / "rl"
    run_train(_config(run, tiny_dir, "ppo.trainer=process", "steps=2"), progress=False)
    tl = read_timeline(run)
    assert tl.processes["trainer/policy"].startswith("trainer-policy")
    assert tl.busy_share("trainer/policy") > 0
    assert {p.name.split(".")[0] for p in (run / "timeline").iterdir()} == {"driver", "trainer-policy"}
