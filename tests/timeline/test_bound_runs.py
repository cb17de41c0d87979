"""Three real short training runs, each bound on purpose, and the bottleneck report on each names its bound:
long generations and a cheap update (rollout/generation), short generations and a heavy update (training),
an env whose steps sleep (env). Their traces open as JSON with the driver's steps and the episodes in them."""

from __future__ import annotations

import json

import pytest

from areal_agents.config import TrainConfig, load_config
from areal_agents.timeline.bottleneck import bottleneck_report
from areal_agents.timeline.trace import write_trace
from areal_agents.trainers.rl_recipe import run_train

COMMON = [
    "steps=3", "eval.num_problems=1", "rollout.batch_size=2", "rollout.group_size=4", "rollout.max_staleness=0",
    "ppo.filter_zero_variance_groups=false", "timeline.heatmap_every=0",  # no per-step picture between the steps
]  # fmt: skip
RUNS = {
    "rollout/generation": ["rollout.max_new_tokens=160"],
    "training": ["rollout.max_new_tokens=4", "ppo.ppo_epochs=8", "ppo.num_minibatches=4"],
    "env": [
        "rollout.max_new_tokens=4", "env.module=areal_agents.envs.testing", "env.id=areal_agents_testing/Slow-v0",
        "env.kwargs={max_turns: 3, step_seconds: 0.2}",
    ],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("bound", list(RUNS))
def test_a_run_bound_on_purpose_is_reported_so(bound, tiny_dir, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(TrainConfig, None, [f"run_dir={run}", f"model.path={tiny_dir}", *COMMON, *RUNS[bound]])
    run_train(cfg, progress=False)
    report = bottleneck_report(run)
    print("\n".join(report.lines()))  # the docs' example comes from here (-s)
    assert report.steps == 3 and report.bound == bound, "\n".join(report.lines())
    assert report.key and report.key in report.advice
    trace = json.loads(write_trace(run).read_text())
    slices = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert slices.count("step") == 3 and {"rollout_wait", "update", "episode", "generate"} <= set(slices)
    if bound == "env":
        assert "env_step" in slices
