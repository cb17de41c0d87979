"""The debate recipe trains behind serve-env (``env.backend=server``): the run launches an env server, and every
episode of the multi-agent env is created and stepped over protocol v2 — with one shared policy, and with a
LoRA adapter per debater."""

import json
from pathlib import Path

import pytest

from areal_agents.cli import main
from areal_agents.envs.runtime.remote import RemoteEnvPool

pytestmark = pytest.mark.process

DEBATE = Path(__file__).resolve().parents[2] / "examples" / "debate"


@pytest.mark.parametrize("recipe, lora", [("rl.yaml", False), ("rl_separate.yaml", True)])
def test_debate_trains_behind_serve_env(tmp_path, tiny_dir, recipe, lora, monkeypatch):
    sent = []
    request = RemoteEnvPool._request

    async def record(self, method, url, body=None):  # the run's requests still go to its server
        sent.append((method, url.split("/", 3)[-1], body))
        return await request(self, method, url, body)

    monkeypatch.setattr(RemoteEnvPool, "_request", record)
    run = tmp_path / "debate"
    small = ["env.backend=server", "steps=2", "eval.num_problems=4", "rollout.batch_size=2", "rollout.group_size=4"]
    small += ["env.kwargs.task_kwargs={digits: 1}", "eval.env_kwargs={task_kwargs: {digits: 1, split: test}}"]
    small += ["ppo.filter_zero_variance_groups=false", f"model.path={tiny_dir}", f"run_dir={run}"]
    if lora:
        small += ["policies.debater_0.lora.r=8", "policies.debater_1.lora.r=8", "ppo.lr=1e-3"]
    assert main(["train", str(DEBATE / recipe), *small, "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine_version"] == 2 and summary["episodes"]["accepted"] == 16
    assert summary["episodes"]["env_failed"] == 0
    paths = [path for _, path, _ in sent]
    steps = [item for _, path, body in sent if path == "v2/step" for item in body["steps"]]
    assert all(set(item["actions"]) == {"debater_0", "debater_1"} for item in steps)  # both debaters act each round
    # 16 training episodes and the 4 held-out problems twice, 2 rounds each, batched as the episodes go
    assert paths.count("v2/sessions") >= 16 + 2 * 4 and len(steps) >= 2 * (16 + 2 * 4)
    assert "v1/step" not in paths and "v1/sessions" not in paths

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(run / "tensorboard")).Reload()
    tags = scalars.Tags()["scalars"]
    for agent in ("debater_0", "debater_1"):
        assert f"rollout/reward_agent/{agent}" in tags and f"eval/accuracy/{agent}" in tags
        if lora:  # each debater's adapter trained on its own trajectories, each step
            assert len(scalars.Scalars(f"train/{agent}/trained_trajectories")) == 2
