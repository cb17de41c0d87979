"""A step's figures: MFU from the updates' model FLOPs, GPU memory, weight pushes; segments and tool calls."""

import pytest

from areal_agents.trainers.step_metrics import StepTimes, episode_shape, train_stats, trainer_perf
from areal_agents.types import Trajectory


def test_mfu_is_model_flops_over_training_seconds_less_the_push_against_the_peak():
    times = StepTimes(start=0.0, rollout_end=1.0, end=11.0, waited=1.0, push=2.0, pushed_bytes=4e9)  # 8 s of update
    per_policy = {
        "policy": {
            "loss": 0.5,
            "model_flops": 4e15,
            "peak_flops": 1e15,
            "trained_tokens": 1000.0,
            "perf/gpu_memory_peak_gib": 30.0,
        }
    }
    perf = trainer_perf(per_policy, times)
    assert perf["mfu"] == pytest.approx(0.5)
    assert perf["model_tflops_per_s"] == pytest.approx(500.0)
    assert perf["gpu_memory_peak_gib"] == 30.0
    assert perf["weight_sync_seconds"] == 2.0 and perf["weight_sync_bytes"] == 4e9
    train = train_stats(per_policy)
    assert train["loss"] == 0.5 and not {"model_flops", "peak_flops", "trained_tokens"} & set(train)
    assert not any(k.startswith("perf/") for k in train)


def test_no_mfu_without_a_known_peak_and_nothing_on_a_cpu_run_that_reports_no_flops():
    times = StepTimes(start=0.0, rollout_end=1.0, end=3.0, waited=0.0)
    assert "mfu" not in trainer_perf({"policy": {"model_flops": 1e12, "peak_flops": 0.0}}, times)
    assert trainer_perf({"policy": {"loss": 1.0}}, times) == {"weight_sync_seconds": 0.0, "weight_sync_bytes": 0.0}


def test_episode_shape_counts_each_episode_once_whatever_its_segments():
    def traj(episode, segment, segments, calls, failures, agent="agent"):
        meta = {"segment": segment, "num_segments": segments, "tool_calls": calls, "tool_parse_failures": failures}
        return Trajectory(
            [1, 2], [0, 1], [0.0, -0.1], [-1, 0], reward=0.0, agent_id=agent, episode_id=episode, metadata=meta
        )

    batch = [traj("e0", 0, 2, 3, 1), traj("e0", 1, 2, 3, 1), traj("e1", 0, 1, 0, 0), traj("e1", 0, 1, 1, 2, "b")]
    shape = episode_shape(batch)
    assert shape == {"segments_per_episode": 4 / 3, "tool_calls_per_episode": 4 / 3, "tool_parse_failures": 3.0}
    assert episode_shape([]) == {}
