"""A real short RL run records its timeline: the engine's, the trainer's and the env pool's busy rows, the
queues, CPU use, and the driver's and the episodes' spans, each episode's calls named by its id."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

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


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_dir):
    run = tmp_path_factory.mktemp("timeline") / "rl"
    run_train(_config(run, tiny_dir, "rollout.dump_trajectories=true"), progress=False)
    return run


def test_a_run_records_every_worker_queue_and_event(run):
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
    outcomes = [s.args["outcome"] for s in episodes]  # episodes in flight at the end are cancelled
    assert outcomes.count("accepted") >= 3 * 8 * 4 and set(outcomes) <= {"accepted", "cancelled"}
    ids = {s.args["episode_id"] for s in episodes}
    generates = [s for s in tl.spans if s.name == "generate"]
    steps = [s for s in tl.spans if s.name == "env_step"]
    assert generates and steps and all(s.args["episode_id"] in ids for s in generates + steps)
    # the trainer's busy time is its updates' time: the rows and the spans tell the same story
    updates = sum(s.end - s.start for s in driver if s.name == "update")
    busy = np.nansum(tl.busy["trainer/policy"]) * tl.dt
    assert 0.5 * updates <= busy <= updates + 0.3


def test_tensorboard_shows_the_heatmap_the_queues_and_the_episode_lengths(run):
    main = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0}).Reload()
    heatmaps = main.Images("timeline/heatmap")
    assert [e.step for e in heatmaps] == [1, 2, 3]
    picture = Image.open(io.BytesIO(heatmaps[-1].encoded_image_string))
    assert picture.width >= 600 and picture.height >= 18 + 16 * 3 + 28  # a row for each of 3 workers at least
    assert {"rollout/episode_tokens", "rollout/episode_turns"} <= set(main.Tags()["histograms"])
    queues = EventAccumulator(str(run / "tensorboard" / "timeline")).Reload()
    assert {"rollout/queued_groups", "engine/hf/running", "env/steps_in_flight"} <= set(queues.Tags()["scalars"])
    running = queues.Scalars("rollout/episodes_running")
    steps = [e.step for e in running]
    assert steps == sorted(set(steps)) and len(steps) >= 2  # one point per 100 ms bin (its ms), none twice
    assert all((b - a) % 100 == 0 for a, b in zip(steps, steps[1:]))
    tl = read_timeline(run)
    assert max(e.value for e in running) == np.nanmax(tl.gauges["rollout/episodes_running"])


@pytest.mark.process
def test_a_trainer_process_records_into_the_runs_timeline(tmp_path, tiny_dir):
    run = tmp_path / "rl"
    run_train(_config(run, tiny_dir, "ppo.trainer=process", "steps=2"), progress=False)
    tl = read_timeline(run)
    assert tl.processes["trainer/policy"].startswith("trainer-policy")
    assert tl.busy_share("trainer/policy") > 0
    assert {p.name.split(".")[0] for p in (run / "timeline").iterdir()} == {"driver", "trainer-policy"}


def test_eval_samples_are_dumped_beside_the_trajectories(run):
    """What the dashboard's viewer shows of the held-out evals: every sample, in the trajectories' row format."""
    for step in (0, 3):
        rows = [json.loads(x) for x in (run / "eval_samples" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 4  # eval.num_problems, one sample each
        assert set(rows[0]) == set(json.loads((run / "trajectories" / "step_1.jsonl").read_text().splitlines()[0]))
